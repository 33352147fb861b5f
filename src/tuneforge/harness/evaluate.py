"""lm-evaluation-harness in-process on a model tuneforge loads, and what such a run leaves behind.

- `load_lm(model_dir, batch_size)`: the harness's HFLM built on the model object and tokenizer of a model folder
  (full, or an adapter folder with its adapter merged into its base), loaded as generate and serve load them.
- `prepare_tasks(settings)`: the harness's tasks by name, checked and built (tasks.py), local data swapped in.
- `run_harness(lm, settings, model_args=None)`: `lm_eval.simple_evaluate` on those tasks; `lm` is an LM object or
  any model name the harness knows ("local-completions" with `model_args`, to score a `tuneforge serve` the same
  way); returns the harness's results dict, with no git commit recorded (`no_git_lookup`: the user's repository's).
- `write_results(results, folder)`: results.json (as the harness writes it, made strict JSON) and results.md (the
  harness's make_table), into a folder `check_destination` found new, empty or one a harness run wrote (its files
  recognised by their content: a user's results.json is not replaced).
- `evaluate_model(model_dir, settings, folder)`: all of it, for `tuneforge eval --harness` and after training.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneforge.adapters import load_pretrained_model
from tuneforge.artifacts import (
    FAMILY_CAUSAL,
    check_model_path,
    context_length,
    from_pretrained,
    generation_family,
    inference_device,
    load_tokenizer,
    read_model_info,
)
from tuneforge.errors import ConfigError, DataError
from tuneforge.files import TMP_PREFIX, finite_or_null, replacing
from tuneforge.harness.options import EVAL_SPELLING, HarnessSettings, Spelling
from tuneforge.harness.tasks import build_tasks, task_manager, task_specs
from tuneforge.paths import check_output_dir

HARNESS_MAX_GEN_TOKENS = 256  # HFLM.max_gen_toks: a generation task's length unless the run says
RESULTS_FILE = "results.json"
TABLE_FILE = "results.md"
HARNESS_FILES = (RESULTS_FILE, TABLE_FILE)


@dataclass
class PreparedTasks:
    """The harness's tasks of one run, built (Task and Group objects), and the TaskManager that found them."""

    tasks: list
    manager: Any


# ---- the model ---------------------------------------------------------------------------------
def load_lm(model_dir: str, batch_size: int = 8, device: str | None = None):
    """The harness's HFLM on the model of `model_dir` (a causal LM or seq2seq model; an adapter folder's base with
    the adapter merged in) and its tokenizer, on the inference device."""
    import transformers
    from lm_eval.models.huggingface import HFLM

    check_model_path(model_dir)
    model_config = from_pretrained(transformers.AutoConfig, model_dir, "the model config")
    family = generation_family(model_config, read_model_info(model_dir))
    if family is None:
        archs = getattr(model_config, "architectures", None) or [model_config.model_type]
        raise ConfigError(
            f"model {model_dir!r} is a {archs[0]}, which scores no text; lm-evaluation-harness needs a causal LM or "
            "a sequence-to-sequence model (one trained to generate text)"
        )
    auto = transformers.AutoModelForCausalLM if family == FAMILY_CAUSAL else transformers.AutoModelForSeq2SeqLM
    tokenizer = load_tokenizer(model_dir)
    model = load_pretrained_model(auto, model_dir, "the model").eval().to(inference_device(device))
    backend = "causal" if family == FAMILY_CAUSAL else "seq2seq"
    return HFLM(pretrained=model, tokenizer=tokenizer, backend=backend, batch_size=batch_size)


# ---- the tasks and the run ---------------------------------------------------------------------
def prepare_tasks(settings: HarnessSettings, build: bool = True, spelling: Spelling = EVAL_SPELLING) -> PreparedTasks:
    """The run's tasks: names checked against the harness's index, local data read and checked against each
    task's prompts; `build`: each task built (its hub data loaded) too."""
    manager = task_manager(tuple(settings.tasks))
    specs = task_specs(settings.tasks, settings.data or {}, manager, settings.fewshot, spelling)
    return PreparedTasks(build_tasks(specs, manager, spelling) if build else specs, manager)


def run_harness(
    lm, settings: HarnessSettings, model_args: dict | str | None = None, prepared: PreparedTasks | None = None
) -> dict:
    """`lm_eval.simple_evaluate` of `lm` (an LM object, or a harness model name with `model_args`) on the tasks of
    `settings`; the harness's results dict (without per-row samples)."""
    import lm_eval

    prepared = prepared or prepare_tasks(settings)
    with no_git_lookup():
        return lm_eval.simple_evaluate(
            model=lm,
            model_args=model_args,
            tasks=prepared.tasks,
            task_manager=prepared.manager,
            num_fewshot=settings.fewshot,
            limit=settings.limit,
            batch_size=settings.batch_size,
            gen_kwargs={"max_gen_toks": settings.max_gen_toks} if settings.max_gen_toks else None,
            log_samples=False,
        )


@contextlib.contextmanager
def no_git_lookup():
    """Within the block, the harness records no git commit (git_hash, upper_git_hash: null). It would run `git
    describe` in the working directory (`fatal: not a git repository` on stderr outside one) and read the commit of
    it and of its parent: the user's repository, not the harness's code (lm_eval_version says that); it has no
    setting to skip it, so its two look-ups are swapped for none."""
    import lm_eval.evaluator
    import lm_eval.loggers.utils

    saved = lm_eval.evaluator.get_git_commit_hash, lm_eval.loggers.utils.get_commit_from_path
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    lm_eval.loggers.utils.get_commit_from_path = lambda repo_path: None
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash, lm_eval.loggers.utils.get_commit_from_path = saved


def _leaf_tasks(tasks: list) -> list:
    return [t for item in tasks for t in (item.get_all_tasks() if hasattr(item, "get_all_tasks") else [item])]


GENERATION_LENGTH_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # by priority


def generation_length(task, settings: HarnessSettings) -> tuple[int, str]:
    """The most tokens a generation task generates per row and where that is said: the run's max_gen_toks, else the
    task's own generation_kwargs (under any of the names the harness reads, normalize_gen_kwargs), else HFLM's."""
    if settings.max_gen_toks:
        return settings.max_gen_toks, "run"
    own = getattr(task.config, "generation_kwargs", None) or {}
    length = next((own[k] for k in GENERATION_LENGTH_KEYS if own.get(k) is not None), None)
    return (int(length), "task") if length is not None else (HARNESS_MAX_GEN_TOKENS, "harness")


def check_generation_room(
    context: int, settings: HarnessSettings, tasks: list, spelling: Spelling = EVAL_SPELLING
) -> None:
    """A generation task (gsm8k) generates up to its max_gen_toks tokens after its prompt within the model's
    `context`: a length that leaves no room for the prompt is one line (the harness would fail on the first
    request)."""
    lengths = {
        t.config.task: generation_length(t, settings)
        for t in _leaf_tasks(tasks)
        if hasattr(t, "config") and getattr(t.config, "output_type", None) == "generate_until"
    }
    too_long = {name: how for name, how in lengths.items() if how[0] >= context}
    if too_long:
        flag = spelling.max_gen_toks.removesuffix(" N").removesuffix("=N")
        said = {"run": flag, "task": "its own max_gen_toks", "harness": "the harness's"}
        raise ConfigError(
            "; ".join(f"{name} would generate up to {n} tokens ({said[how]})" for name, (n, how) in too_long.items())
            + f", which fills the model's context of {context} tokens; pass {spelling.max_gen_toks} with N below "
            f"{context}"
        )


def model_context(model_config) -> int | None:
    """The context the harness gives a model of `model_config` where its config says it (of the text model's config
    where it has one; the attributes HFLM reads, as artifacts.context_length reads them), else None (the harness
    asks the tokenizer)."""
    if model_config is None:
        return None
    return context_length(getattr(model_config, "text_config", None) or model_config)


@contextlib.contextmanager
def harness_logs(level: int = logging.ERROR):
    """The harness's own log lines (notes on every task it builds) held back to `level` within the block."""
    logger = logging.getLogger("lm_eval")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


# ---- what a run leaves behind ------------------------------------------------------------------
def json_safe(value: Any) -> Any:
    """The harness's results as strict JSON data: what the harness turns to text for its own results file (numpy
    numbers, functions) as it does, and nan or infinity (a standard error of one row) as null."""
    from lm_eval.utils import handle_non_serializable

    text = json.dumps(value, default=handle_non_serializable, ensure_ascii=False)
    return finite_or_null(json.loads(text))


def results_table(results: dict) -> str:
    """The harness's own markdown table of the scores (and of the groups', when a group ran)."""
    from lm_eval.utils import make_table

    return make_table(results) + (("\n" + make_table(results, "groups")) if results.get("groups") else "")


def check_destination(folder: str | Path, flag: str = "--output-dir") -> None:
    """`folder` can take a harness run's files: new, empty, or holding only what a harness run writes (an earlier
    run's, which this one replaces); anything else in it is someone else's and is refused."""
    out = Path(folder)
    check_output_dir(str(out), flag)
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in HARNESS_FILES and not p.name.startswith(TMP_PREFIX))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(
            f"{flag} {str(out)!r} holds files a harness run does not write ({shown}); choose a new or empty folder"
        )
    clashing = [name for name in HARNESS_FILES if (out / name).exists() and not (out / name).is_file()]
    if clashing:
        raise ConfigError(f"{flag} {str(out)!r} holds a folder named {clashing[0]!r}; choose another folder")
    others = [name for name in HARNESS_FILES if (out / name).is_file() and not written_by_harness(out / name)]
    if others:
        raise ConfigError(
            f"{flag} {str(out)!r} holds a {others[0]} that a harness run did not write; choose a new or empty folder"
        )


def written_by_harness(path: Path) -> bool:
    """An earlier harness run's file: results.json holding the harness's results, results.md its table."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if path.name == TABLE_FILE:
        return text.startswith("|Tasks|")
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and {"results", "configs", "versions"} <= data.keys()


def write_results(results: dict, folder: str | Path) -> dict:
    """results.json and results.md into `folder`, a pair: both are made and written whole to temporaries, then
    renamed into place back to back, so that a failure or a stop while they are made leaves the earlier run's pair
    (the JSON written first, then the table, left a new JSON beside an earlier run's table, or none); returns the
    JSON-safe results."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    safe = json_safe({k: v for k, v in results.items() if k != "samples"})
    scores, table = json.dumps(safe, indent=2, ensure_ascii=False, allow_nan=False) + "\n", results_table(results)
    with (
        replacing(out / RESULTS_FILE, durable=True) as scores_tmp,
        replacing(out / TABLE_FILE, durable=True) as table_tmp,
    ):
        scores_tmp.write_text(scores, encoding="utf-8")
        table_tmp.write_text(table, encoding="utf-8")
    return safe


def evaluate_model(
    model_dir: str,
    settings: HarnessSettings,
    folder: str | Path,
    flag: str = "--output-dir",
    spelling: Spelling = EVAL_SPELLING,
) -> dict:
    """The harness run of `settings` on the model folder `model_dir`, its files written into `folder`: tasks and
    local data checked, then the destination, before the model loads (a folder that is not there is said first: a
    task's hub data may take the hub's timeouts to fail). Returns {results, table, folder}."""
    check_model_path(model_dir)
    with harness_logs():
        specs = prepare_tasks(settings, build=False, spelling=spelling)
        check_destination(folder, flag)
        prepared = PreparedTasks(build_tasks(specs.tasks, specs.manager, spelling), specs.manager)
        lm = load_lm(model_dir, settings.batch_size)
        check_generation_room(lm.max_length, settings, prepared.tasks, spelling)
        try:
            results = run_harness(lm, settings, prepared=prepared)
        except AssertionError:  # HFLM's checks of a request against the model are bare asserts
            raise DataError(
                f"lm-evaluation-harness stopped on a request model {model_dir!r} cannot score (one of its checks "
                f"failed; most often an answer longer than the model's context of {lm.max_length} tokens)"
            ) from None
    safe = write_results(results, folder)
    return {"results": safe, "table": results_table(results), "folder": str(folder)}
