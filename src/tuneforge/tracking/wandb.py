"""Weights & Biases: one W&B run per job (`wandb.init`), in the mode, entity and folder W&B's own settings give
(WANDB_MODE=offline writes a folder that `wandb sync` uploads later; WANDB_ENTITY, WANDB_DIR, WANDB_API_KEY).

Project: --experiment-name, else WANDB_PROJECT, else "tuneforge"; run name: --run-name, else the output dir's name.
Config: the resolved config flattened with dots, its numbers and booleans as such (as transformers' WandbCallback
sends them: W&B sorts and filters them as numbers), sent again by a resume (whose `resume` differs: a killed attempt's
offline folder may not hold it). Tags:
`version=...`, `task=...`, `backend=...`, `device=...`, `world_size=...` (each at most W&B's 64 characters; set again
on a resume). Metrics: each record's numeric values at its step (W&B's step is the training step; a step's train and
eval records share its row). W&B's console capture is off (stdout stays for --json); it is silent under --quiet.

Resume: `wandb.init(id=..., resume="must")` continues the run of the checkpoint, and the re-run steps W&B has are not
sent again, nor are the records before the checkpoint it lacks forgotten:
- online, W&B's server knows the run's last step (`run.starting_step`) and drops anything logged below it: records
  below it are skipped here, those at or above it sent (the records before the checkpoint that the killed attempt's
  W&B process never uploaded among them);
- offline, W&B cannot know (checked with wandb 0.31): the resumed attempt is a new offline folder with the same run
  id, counting from step 0, and `wandb sync` uploads the folders into the one run. What the earlier folders hold is
  read from their `.wandb` files (W&B's transaction log: a header, LevelDB-log blocks of wandb's own protobuf
  `Record`s; wandb ships no Python reader of it since it moved to wandb-core), and each metric is sent from the step
  after its last one there. This matters: W&B writes that file from a buffer, so a SIGKILLed attempt's folder can hold
  none of its records (its first 7 bytes only), and the resume sends the job's records up to the checkpoint again.
  Where those files cannot be read (another format), a note says the steps after the checkpoint may be in the run
  twice, and everything from the checkpoint on is sent.

--log-model: OUTPUT_DIR/model as a W&B Artifact of type "model", named `model-RUNID`. End: `finish` with exit code 0,
or 1 where the run stopped on an error.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from tuneforge.tracking.base import Continued, Point, RunDescription, Tracker, first_line, unlogged

DEFAULT_PROJECT = "tuneforge"
TAG_LIMIT = 64  # W&B refuses longer tags
# the .wandb transaction log: ":W&B", a 2-byte magic and a version byte; then 32 KiB blocks of records, each a 7-byte
# header (crc32c, little-endian length, type: 1 whole, 2 first part, 3 middle part, 4 last part) and its bytes
HEADER, HEADER_SIZE, BLOCK, RECORD_HEADER = b":W&B", 7, 32768, 7


class WandbTracker(Tracker):
    name = "wandb"
    package = "wandb"
    extra = "wandb"
    names_runs = True
    logs_model = True

    def __init__(self, run: RunDescription, continued: Continued | None) -> None:
        import wandb

        from tuneforge.launch import env_flag

        resuming = continued is not None and continued.run_id is not None
        tags = [f"{key.removeprefix('tuneforge.')}={value}"[:TAG_LIMIT] for key, value in run.tags.items()]
        self.run = wandb.init(
            project=run.experiment or env_flag("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=run.name,
            id=continued.run_id if resuming else None,
            resume="must" if resuming else None,
            config=run.params,  # on a resume too: a killed attempt's offline folder may not hold it
            tags=tags,
            settings=wandb.Settings(console="off", silent=run.quiet),
            reinit="create_new",
        )
        self.run_id = self.run.id
        self.last_steps: dict[str, int] = {}
        self.below = 0  # steps below this one are W&B's already (online: the server's next step)
        if resuming:
            self.run.tags = tuple(tags)  # this attempt's backend, device and world size
            if self.run.offline:
                self.last_steps = self._logged_offline()
            else:
                self.below = self.run.starting_step
        if continued is not None:  # records from before the checkpoint the run lacks (all, for a new run)
            for point in continued.kept:
                self.log(point)

    def _logged_offline(self) -> dict[str, int]:
        """The last step of each metric in this run's earlier offline folders (beside this attempt's)."""
        here = Path(self.run.dir).parent
        earlier = sorted(p for p in here.parent.glob(f"*-{self.run.id}/run-{self.run.id}.wandb") if p.parent != here)
        try:
            return logged_steps(earlier)
        except ValueError as err:
            print(
                f"note: W&B's earlier offline files of run {self.run.id} are not readable ({first_line(err)}): the "
                "steps after the checkpoint are logged again and may be in the run twice",
                file=sys.stderr,
            )
            return {}

    def log(self, point: Point) -> None:
        if point.step < self.below:
            return
        metrics = unlogged(point, self.last_steps)
        if metrics:
            self.run.log(metrics, step=point.step)

    def log_model(self, folder: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"model-{self.run.id}", type="model")
        artifact.add_dir(str(folder))
        self.run.log_artifact(artifact)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)

    def abandon(self) -> None:
        self.run.finish(exit_code=1)


def log_records(data: bytes) -> Iterator[bytes]:
    """The records of a .wandb file's bytes (ValueError where it is not one); a record cut short by a kill ends it."""
    if data[: len(HEADER)] != HEADER:
        raise ValueError("no W&B transaction-log header")
    pos, parts = HEADER_SIZE, b""
    while pos + RECORD_HEADER <= len(data):
        if BLOCK - pos % BLOCK < RECORD_HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + RECORD_HEADER])
        chunk = data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        if len(chunk) < length or kind not in (1, 2, 3, 4):  # written in part, or zeros: the end of what was written
            return
        pos += RECORD_HEADER + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            yield parts


def logged_steps(files: Iterable[Path]) -> dict[str, int]:
    """The last step of each metric in W&B transaction logs (`.wandb` files): their history records' keys (W&B's own
    `_step`, `_runtime`... left out)."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    last: dict[str, int] = {}
    for path in files:
        for raw in log_records(Path(path).read_bytes()):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(raw)
            except DecodeError:
                break
            if record.WhichOneof("record_type") != "history":
                continue
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    last[key] = max(last.get(key, -1), record.history.step.num)
    return last


TRACKER = WandbTracker
