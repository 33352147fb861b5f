"""`tuneforge ...` with Checkpointer.save/load timed (used by checkpoints.py).

Self-launch re-runs this script in every worker, so the timers are in place on each rank; rank 0
appends {"save_s"| "load_s": ...} lines to $TUNEFORGE_TIMINGS (read through tuneforge.launch.env_flag).
"""

import json
import sys
import time

from tuneforge import checkpoint
from tuneforge.cli import main
from tuneforge.launch import env_flag


def timed(name, fn):
    def wrapper(checkpointer, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(checkpointer, *args, **kwargs)
        checkpointer.backend.barrier()
        if checkpointer.backend.is_main and env_flag("TUNEFORGE_TIMINGS"):
            with open(env_flag("TUNEFORGE_TIMINGS"), "a") as fh:
                fh.write(json.dumps({name: round(time.perf_counter() - t0, 3)}) + "\n")
        return out

    return wrapper


checkpoint.Checkpointer.save = timed("save_s", checkpoint.Checkpointer.save)
checkpoint.Checkpointer.load = timed("load_s", checkpoint.Checkpointer.load)
sys.exit(main())
