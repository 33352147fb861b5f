"""The harness after training (`harness_after_train` / `--harness-after-train TASKS`): checked before the run
trains (task names, each task's data, the OUTPUT_DIR/harness folder, a generation length against the model's
context), run on the exported model once it is written; errors name the train run's spelling of the way out.
The Trainer calls these two, in the process that shows the run's result; an --overwrite run's start clears the
replaced run's scores (`clear_scores`).

The scores join the run's result (result.json) as metrics (`run_metrics`), named so that `tuneforge sweep --metric`
and YAML take them as they are: `harness/TASK/METRIC` for the harness's `METRIC,none` and `harness/TASK/METRIC/FILTER`
for `METRIC,FILTER` (gsm8k's `exact_match,strict-match` is `harness/gsm8k/exact_match/strict-match`); standard errors
stay in OUTPUT_DIR/harness/results.json. Not in metrics.jsonl: its records are the run's evaluations by step (the
pruner's, the best model's, the trackers'), and these come once, after the export, from another model load."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from tuneforge.errors import ConfigError, UserError
from tuneforge.harness.options import METRIC_PREFIX, TRAIN_SPELLING, HarnessSettings

HARNESS_FOLDER = "harness"
FLAG = "--harness-after-train"
NO_FILTER = "none"  # the harness's filter name of a metric taken as the model answered


def harness_folder(output_dir: str | Path) -> Path:
    return Path(output_dir) / HARNESS_FOLDER


def check_after_train(
    settings: HarnessSettings, output_dir: str | Path, generates: bool = True, model_config=None
) -> None:
    """Before training, what can be checked without the trained model (one line, before minutes of training): the
    tasks built (their data had), the destination, and a generation length against the context of `model_config`
    (the model to train, where known); `generates`: whether the run's task makes a model that scores text."""
    from tuneforge.harness.evaluate import (
        check_destination,
        check_generation_room,
        harness_logs,
        model_context,
        prepare_tasks,
    )

    if not generates:
        raise ConfigError(
            f"{FLAG}: this run's task trains a model that scores no text (a classifier, tagger or the like); "
            "lm-evaluation-harness needs a causal LM or a sequence-to-sequence model (e.g. --task clm or sft)"
        )
    with harness_logs():
        prepared = prepare_tasks(settings, spelling=TRAIN_SPELLING)
    check_destination(harness_folder(output_dir), f"{FLAG}'s folder")
    context = model_context(model_config)
    if context:
        check_generation_room(context, settings, prepared.tasks, TRAIN_SPELLING)


def after_training(settings: HarnessSettings, model_dir: str, output_dir: str | Path, quiet: bool = False) -> dict:
    """The harness on the exported `model_dir`, into OUTPUT_DIR/harness; its table printed unless `quiet`.
    Returns {task: {metric: value}} for the run's result."""
    from tuneforge.harness.evaluate import evaluate_model

    folder = harness_folder(output_dir)
    try:
        done = evaluate_model(model_dir, settings, folder, f"{FLAG}'s folder", TRAIN_SPELLING)
    except UserError as err:
        raise type(err)(
            f"training finished (model saved to {model_dir}), but the harness run after it failed: {err}"
        ) from None
    if not quiet:
        print(f"lm-evaluation-harness on {model_dir} ({folder}):\n{done['table']}", file=sys.stdout, flush=True)
    return done["results"].get("results", {})


def clear_scores(output_dir: str | Path) -> None:
    """An --overwrite run's start: the replaced run's harness files go (they score a model that is gone); other
    files stay, and so does the folder while it holds any."""
    from tuneforge.harness.evaluate import HARNESS_FILES, written_by_harness

    folder = harness_folder(output_dir)
    if folder.is_symlink() or not folder.is_dir():
        return
    for name in HARNESS_FILES:
        if (folder / name).is_file() and written_by_harness(folder / name):
            (folder / name).unlink()
    with contextlib.suppress(OSError):  # not empty: the user's files are in it
        folder.rmdir()


def run_metrics(scores: dict) -> dict[str, float | None]:
    """The harness's {task: {"METRIC,FILTER": value}} as the run's metrics {"harness/TASK/METRIC[/FILTER]": value}:
    its numbers (null: undefined), without the standard errors and the harness's notes (alias, sample_len)."""
    metrics: dict[str, float | None] = {}
    for task, values in scores.items():
        for key, value in values.items():
            metric, comma, filter_name = key.partition(",")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not comma or metric.endswith("_stderr") or not (number or value is None):  # "N/A": no value
                continue
            name = f"{METRIC_PREFIX}{task}/{metric}" + ("" if filter_name == NO_FILTER else f"/{filter_name}")
            metrics[name] = None if value is None else float(value)
    return metrics


def higher_is_better(name: str) -> bool:
    """How the harness metric `name` ranks: as the harness's metric registry says (bits_per_byte and the
    perplexities: lower), else as tuneforge ranks a metric it does not know (lower for a loss, perplexity or error)."""
    from tuneforge.config import lower_is_better

    metric = name.removeprefix(METRIC_PREFIX).split("/")[1:2]
    try:
        from lm_eval.api.registry import is_higher_better

        from tuneforge.harness.evaluate import harness_logs
    except ImportError:  # the harness is not installed: a trial would say so
        return not lower_is_better(name)
    with harness_logs():  # its warning on a metric it does not know: the run's own ranking applies
        known = is_higher_better(metric[0]) if metric else None
    return known if isinstance(known, bool) else not lower_is_better(name)
