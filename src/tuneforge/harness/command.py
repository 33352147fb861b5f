"""`tuneforge eval MODEL --harness TASKS`: the eval command's second mode, lm-evaluation-harness in-process
instead of a config's task. Its flags are HarnessSettings' (`add_harness_flags`, under dests `harness.NAME` so
they never meet eval's own); `harness_given` tells the mode from the parsed flags, `cmd_eval_harness` runs it:
the results into --output-dir (results.json, results.md), the table on stdout.
"""

from __future__ import annotations

import argparse
import json

from tuneforge.errors import ConfigError
from tuneforge.flags import model_flags, parse_options
from tuneforge.harness.options import HarnessSettings

PREFIX = "harness."
DEFAULT_OUTPUT_DIR = "runs/harness"


def add_harness_flags(parser: argparse.ArgumentParser) -> None:
    """HarnessSettings' flags, in a group of their own; none required (the mode is chosen by --harness)."""
    group = parser.add_argument_group("lm-evaluation-harness (instead of a config's task)")
    for flag, (key, kwargs) in model_flags(HarnessSettings, PREFIX).items():
        group.add_argument(flag, dest=key, default=None, **{**kwargs, "required": False})


def harness_given(ns: argparse.Namespace) -> dict:
    """The harness flags given ({field: value}); a harness flag without --harness is one line."""
    given = {k.removeprefix(PREFIX): v for k, v in vars(ns).items() if k.startswith(PREFIX) and v is not None}
    if given and "tasks" not in given:
        flags = {key: flag for flag, (key, _) in model_flags(HarnessSettings).items()}
        raise ConfigError(
            f"{', '.join(flags[k] for k in given)} needs --harness TASKS (e.g. --harness piqa,gsm8k); without it "
            "`tuneforge eval` evaluates a config's task"
        )
    return given


def cmd_eval_harness(ns: argparse.Namespace, given: dict, task_flags: list[str]) -> int:
    """The harness on ns.model_dir; `task_flags`: eval's own flags that were given, which do not apply here."""
    from tuneforge.harness.evaluate import evaluate_model

    settings = parse_options(HarnessSettings, given)
    if task_flags:
        raise ConfigError(
            f"{', '.join(task_flags)} set up evaluation of a config's task and do not apply with --harness (the "
            "harness's tasks bring their own data and prompts; see --harness-data, --harness-limit, "
            "--harness-batch-size)"
        )
    if not ns.model_dir:
        raise ConfigError("--harness needs a model folder: tuneforge eval MODEL_DIR --harness piqa,gsm8k")
    folder = ns.output_dir or DEFAULT_OUTPUT_DIR
    done = evaluate_model(ns.model_dir, settings, folder)
    print(done["table"], flush=True)
    print(f"results written to {folder}/results.json and results.md", flush=True)
    if ns.json:
        print(json.dumps({"results": done["results"].get("results", {}), "output_dir": folder}), flush=True)
    return 0
