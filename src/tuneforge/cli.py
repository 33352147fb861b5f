"""`tuneforge` command line: train, eval, prepare, predict, export, generate, chat, serve, sweep, runs, download, env.

Every user error ends with one line on stderr and exit code 2, one a launched worker finds too (said once, by the
launcher); a failed worker with exit 1. Anything else is a bug in tuneforge: one line on stderr saying so and where
its traceback was written, exit 1.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import re
import sys
from collections.abc import Callable
from os.path import expanduser
from pathlib import Path
from typing import Any

from tuneforge import launch, stops
from tuneforge.errors import ConfigError, UserError
from tuneforge.files import json_text
from tuneforge.flags import model_flags
from tuneforge.reporting import hide_deepspeed_cpu_notice


# ---- flags, generated from the config models (tuneforge.flags) ---------------------------------
# flag -> (config key, argparse kwargs). Flags left unset do not override YAML/defaults.
def _options_flags(
    classes: dict[str, type], owners: dict[str, list[str]], kind: str
) -> tuple[dict[str, tuple[str, dict[str, Any]]], dict[str, str]]:
    """Each task's or backend's Options as flags (`--doc-stride`, `--zero-stage`), and the help group of each.
    `classes`: {name: task or backend class}; `owners`: the registry's {option: names}; `kind`: "task" or "backend"."""
    flags, groups = {}, {}
    for cls in classes.values():
        for flag, (key, kwargs) in model_flags(cls.Options, f"{kind}_options.").items():
            if flag not in flags:  # an option several share (a parent's, or a backend subclass's) is one flag
                flags[flag] = (key, kwargs)
                groups[key] = f"{kind} {' or '.join(owners[key.split('.', 1)[1]])} options ({kind}_options.*)"
    return flags, groups


@functools.cache
def _train_flags() -> tuple[dict[str, tuple[str, dict[str, Any]]], dict[str, str], tuple[str, ...]]:
    """(flag table, help group of each config key, the keys `eval` takes). Built on first use: it imports every
    task and backend."""
    from tuneforge.backends import backend_classes, option_owners
    from tuneforge.config import DataConfig, OptimConfig, TrainConfig
    from tuneforge.tasks import task_classes, task_names, task_option_owners

    task_flags, task_groups = _options_flags(task_classes(), task_option_owners(), "task")
    backend_flags, backend_groups = _options_flags(backend_classes(), option_owners(), "backend")
    flags = {
        **model_flags(TrainConfig, skip=("optim", "data", "task_options", "backend_options")),
        **task_flags,
        **backend_flags,
        **model_flags(OptimConfig, "optim."),
        **model_flags(DataConfig, "data."),
    }
    flags["--task"][1]["help"] += f"; one of: {', '.join(task_names())}"
    _name_task_defaults(flags, task_classes())
    groups = {**task_groups, **backend_groups}
    titles = {"": "run options", "optim": "optimizer options (optim.*)", "data": "data options (data.*)"}
    for key, _ in flags.values():
        if key not in groups:
            groups[key] = titles[key.rpartition(".")[0]]
    models = {"": TrainConfig, "data": DataConfig}
    eval_keys = tuple(
        key
        for key, _ in flags.values()
        # a backend's options too: eval runs on the backend it names (--tp-size, --zero-stage)
        if key.startswith(("task_options.", "backend_options."))
        or _marked_eval(models.get(key.rpartition(".")[0]), key)
    )
    return flags, groups, eval_keys


def _name_task_defaults(flags: dict[str, tuple[str, dict[str, Any]]], classes: dict[str, type]) -> None:
    """Each flag whose default a task sets its own way (its Options.run_defaults) names that task's value in its
    help, `(default: 16; grpo: 2)`: the default alone was wrong for that task."""
    own: dict[str, list[str]] = {}
    for name, cls in sorted(classes.items()):
        for key, value in cls.Options.run_defaults.items():
            shown = ("on" if value else "off") if isinstance(value, bool) else value
            own.setdefault(key, []).append(f"{name}: {shown}")
    for key, kwargs in flags.values():
        if key in own:
            help_text = kwargs["help"].replace(", or the task's", "")  # a switch's: the tasks are named now
            at = help_text.rindex("(default: ") + len("(default: ")
            end = min(i for i in (help_text.find(";", at), help_text.find(")", at)) if i >= 0)
            kwargs["help"] = f"{help_text[:end]}; {', '.join(own[key])}{help_text[end:]}"


def _marked_eval(model, key: str) -> bool:
    field = model.model_fields.get(key.rpartition(".")[2]) if model else None
    return field is not None and isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("eval")


def train_flags() -> dict[str, tuple[str, dict[str, Any]]]:
    """`tuneforge train`'s flags: flag -> (config key, argparse kwargs)."""
    return _train_flags()[0]


def eval_keys() -> tuple[str, ...]:
    """The config keys `tuneforge eval` takes: the fields marked EVAL (config.py), each task's and backend's options."""
    return _train_flags()[2]


def eval_flags() -> dict[str, tuple[str, dict[str, Any]]]:
    """`tuneforge eval`'s flags: those of train whose config key `eval_keys` lists."""
    keys = set(eval_keys())
    return {flag: spec for flag, spec in train_flags().items() if spec[0] in keys}


def _add_flags(parser: argparse.ArgumentParser, table: dict) -> None:
    groups: dict[str, Any] = {}
    for flag, (key, kwargs) in table.items():
        title = _train_flags()[1].get(key, "run options")
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        groups[title].add_argument(flag, dest=key, default=None, **kwargs)


def _flags(ns: argparse.Namespace, table: dict) -> dict[str, Any]:
    return {key: getattr(ns, key) for key, _ in table.values() if getattr(ns, key, None) is not None}


OVERRIDE_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _split_positionals(items: list[str]) -> tuple[str | None, list[str]]:
    from pathlib import Path

    yaml_path, overrides = None, []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif (
            OVERRIDE_KEY.fullmatch(item)
            and not Path(item).exists()
            and Path(item).suffix.lower() not in (".yaml", ".yml", ".json")
        ):
            raise UserError(
                f"{item!r} is neither a config file nor a key=value override; did you mean {item}=VALUE? "
                "(a config file is a YAML file such as configs/glue-mrpc.yaml)"
            )
        elif yaml_path is None:
            yaml_path = item
        else:
            raise UserError(f"unexpected argument {item!r}; give one config file and key=value overrides")
    return yaml_path, overrides


def _emit(result: dict, as_json: bool, headline: str | None = None) -> None:
    if headline:
        print(headline, flush=True)
    if as_json:
        print(json_text(result), flush=True)


# ---- commands ------------------------------------------------------------------------------
def machine() -> str:
    """Where a run ran, for its last line: the GPU's name, or the CPU and its class."""
    import torch

    from tuneforge.environment import cpu_class

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_class()


def cmd_train(ns: argparse.Namespace) -> int:
    from tuneforge.config import apply_overrides, check_given_now
    from tuneforge.configure import check_options_given, config_from_sources
    from tuneforge.trainer import Trainer

    yaml_path, overrides = _split_positionals(ns.config)
    flags = _flags(ns, train_flags())
    # no --task: the config infers it from the data files (config._task_from_files)
    config = config_from_sources(yaml_path, overrides, flags)
    typed = apply_overrides({}, overrides)
    check_given_now(config, flags, typed)  # what would do nothing (a config file's may)
    check_options_given(config, flags, typed)
    if config.resume:  # a checkpoint of another task or model, or none: one line before any work
        from tuneforge.checkpoint import check_resumable

        check_resumable(config)
    else:  # OUTPUT_DIR/config.yaml as the config file: the run would write its own over it
        from tuneforge.paths import check_inputs_outside_run

        check_inputs_outside_run(config.output_dir, {"the config file": yaml_path})
    result = Trainer(config, fork_workers=True).fit()
    if not result or not launch.prints_result():  # a non-main node, or a worker (its launcher prints)
        return 0
    shown = {k: v for k, v in result.items() if isinstance(v, float) and k not in ("wall_s", "data_wait_s")}
    headline = (
        None
        if config.quiet and ns.json
        else (
            "final: "
            + ", ".join(f"{k} {v:.4f}" for k, v in shown.items())
            + f"\nmodel saved to {result['model_dir']}\ntook {result['wall_s']:.0f} s on {machine()}"
            + f" ({result.get('data_wait_s', 0):.1f} s of it waiting for data)"
        )
    )
    _emit(result, ns.json, headline)
    return 0


def cmd_prepare(ns: argparse.Namespace) -> int:
    from tuneforge.config import apply_overrides, check_given_now
    from tuneforge.configure import check_options_given, config_from_sources
    from tuneforge.prepare import prepare

    yaml_path, overrides = _split_positionals(ns.config)
    flags = _flags(ns, train_flags())
    config = config_from_sources(yaml_path, overrides, flags)
    typed = apply_overrides({}, overrides)
    check_given_now(config, flags, typed)  # the command line `train` takes, checked alike
    check_options_given(config, flags, typed)
    result = prepare(config, log=lambda line: print(line, file=sys.stderr, flush=True))
    rows = f"{result['train_rows']:,} training and {result['validation_rows']:,} validation examples"
    _emit(result, ns.json, f"prepared {rows} in {result['wall_s']:.0f} s; `tuneforge train` of this config reads them")
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from tuneforge.configure import build_config, check_options_given
    from tuneforge.harness.command import cmd_eval_harness, harness_given

    harness = harness_given(ns)
    flags = _flags(ns, eval_flags())
    if harness:  # the second mode: lm-evaluation-harness's tasks (tuneforge/harness/)
        return cmd_eval_harness(ns, harness, [f for f, (key, _) in eval_flags().items() if key in flags])
    from tuneforge.trainer import Trainer

    typed = dict(flags)  # the folder's own settings, merged in below, are its task's
    flags["quiet"] = flags.get("quiet", False)
    trained = _trained_task(ns.model_dir)
    if trained and flags.get("task", trained) == trained:  # the folder's own settings unless a flag says
        flags = {**_trained_settings(ns.model_dir, flags), **flags}
    values: dict[str, Any] = {}
    for key, value in flags.items():
        section, _, name = key.rpartition(".")
        (values.setdefault(section, {}) if section else values)[name or key] = value
    values["model"] = ns.model_dir
    values["output_dir"] = ns.output_dir or "runs/eval"
    if trained:  # a folder tuneforge exported evaluates as the task it was trained for, unless --task says
        values.setdefault("task", trained)
    config = build_config(values)
    check_options_given(config, typed, {})  # as train: another task's option does nothing, at its default too
    if trained:
        _check_same_kind(config.task, trained, ns.model_dir)
    metrics = Trainer(config, fork_workers=True).validate()
    if not metrics or not launch.prints_result():
        return 0
    if not ns.json or not config.quiet:
        print(", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()), flush=True)
    _emit(metrics, ns.json)
    return 0


def _trained_task(model_dir: str) -> str | None:
    """The task a model folder tuneforge exported was trained for (its tuneforge.json), else None."""
    from tuneforge.artifacts import read_model_info

    return read_model_info(model_dir).get("task") if Path(model_dir).is_dir() else None


def _trained_settings(model_dir: str, given: dict[str, Any]) -> dict[str, Any]:
    """The eval settings a folder's tuneforge.json records of its training (max_length, QA's doc_stride, a
    seq2seq model's source_prefix and num_beams, a causal LM's block_size, ...) as config keys, so that `eval`
    reads the data as the run that trained it did (as predict and generate do); said in one line."""
    from tuneforge.artifacts import read_model_info, trained_settings_line
    from tuneforge.tasks import task_class

    info = read_model_info(model_dir)
    options = task_class(info["task"]).Options.model_fields  # (a GRPO folder records a block_size it derived)
    keys = {
        key.rpartition(".")[2]: key
        for key in eval_keys()
        if key.startswith("data.") or (key.startswith("task_options.") and key.rpartition(".")[2] in options)
    }
    taken = {
        keys[name]: value
        for name, value in info.items()
        if name in keys and name not in INPUT_NAMING and keys[name] not in given and value is not None
    }
    if taken and not given.get("quiet"):
        print(trained_settings_line({key.rpartition(".")[2]: v for key, v in taken.items()}), flush=True)
    return taken


INPUT_NAMING = ("text_columns",)  # how predict reads rows, not how the model reads text: the data file decides


def _check_same_kind(task: str, trained: str, model_dir: str) -> None:
    """--task names a model of the kind the folder holds (any two generating tasks are: causal LMs); another kind
    would put a new, untrained head on it and score that."""
    from tuneforge.tasks import task_class

    given, made = task_class(task), task_class(trained)
    if given.model_kind != made.model_kind and not (given.generates and made.generates):
        raise ConfigError(
            f"model {model_dir!r} was trained as {trained} ({made.model_kind}); --task {task} evaluates "
            f"{given.model_kind}, which would score a new, untrained head on it: drop --task or train for {task}"
        )


def cmd_env(ns: argparse.Namespace) -> int:
    from tuneforge.environment import collect_env, format_env

    info = collect_env()
    print(json_text(info, indent=2) if ns.json else format_env(info), flush=True)
    return 0


# ---- the parser: each command's arguments, built only for the command that runs ------------------
# The arguments written here (not from an options model) take a leading ~ as the home folder with type=expanduser,
# as a PATH field does in flags.parse_options: `--output-dir=~/e` and a quoted '~/c.yaml' meet no shell. (An
# override, key=VALUE, never starts with ~.)
def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", nargs="*", type=expanduser, help="optional YAML config, then key=value overrides (optim.lr=3e-5)"
    )
    _add_flags(p, train_flags())
    p.add_argument("--json", action="store_true", help="last stdout line: the final metrics as JSON")
    p.set_defaults(func=cmd_train)


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config",
        nargs="*",
        type=expanduser,
        help="the YAML config of the runs to prepare for, then key=value overrides",
    )
    _add_flags(p, train_flags())
    p.add_argument("--json", action="store_true", help="last stdout line: rows prepared, as JSON")
    p.set_defaults(func=cmd_prepare)


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    from tuneforge.harness.command import add_harness_flags

    p.add_argument(
        "model_dir",
        nargs="?",
        default=None,
        type=expanduser,
        help="HF model folder (default: the task's bundled model)",
    )
    _add_flags(p, eval_flags())
    add_harness_flags(p)
    p.add_argument(
        "--output-dir",
        default=None,
        type=expanduser,
        help="with --harness: the folder results.json and results.md go to (default: runs/harness); a task's "
        "evaluation writes nothing",
    )
    p.add_argument("--json", action="store_true", help="last stdout line: the metrics as JSON")
    p.set_defaults(func=cmd_eval)


def _env_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print it as one JSON object")
    p.set_defaults(func=cmd_env)


def _module_arguments(module: str) -> Callable[[argparse.ArgumentParser], None]:
    """A command whose module owns its arguments (`add_arguments`): imported only when that command
    runs (it imports torch); a module that fails to import fails its command loudly, never drops it."""

    def add(p: argparse.ArgumentParser) -> None:
        importlib.import_module(module).add_arguments(p)

    return add


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "train": ("fine-tune a model (config file, key=value overrides, flags)", _train_arguments),
    "eval": (
        "evaluate a model on a task's validation data, or on lm-evaluation-harness tasks (--harness)",
        _eval_arguments,
    ),
    "prepare": (
        "tokenize a config's data once into memory-mapped shards that its runs read (data sources, any size)",
        _prepare_arguments,
    ),
    "predict": (
        "label, tag, answer or embed the rows of a csv/tsv/json(l)/parquet file with a model tuneforge exported",
        _module_arguments("tuneforge.predict"),
    ),
    "env": ("versions, devices, launcher and usable backends (for bug reports)", _env_arguments),
    "export": (
        "write a checkpoint or model as a standalone HF model folder, or a GGUF file (--format gguf)",
        _module_arguments("tuneforge.export"),
    ),
    "generate": (
        "generate text with a causal LM or sequence-to-sequence model",
        _module_arguments("tuneforge.generate"),
    ),
    "chat": (
        "talk to a chat model (one fine-tuned on conversations) in the terminal",
        _module_arguments("tuneforge.chat"),
    ),
    "serve": (
        "serve a model over HTTP: OpenAI-compatible generation, /predict for classifiers, a web page",
        _module_arguments("tuneforge.serve"),
    ),
    "sweep": (
        "search hyperparameters with Optuna: each trial a train run; pruning, --resume after a kill",
        _module_arguments("tuneforge.sweep"),
    ),
    "download": ("download a model or dataset repo from the Hugging Face hub", _module_arguments("tuneforge.download")),
    "runs": (
        "compare runs: the config keys that differ, final and best metrics, speed; a plot of their curves",
        _module_arguments("tuneforge.runs"),
    ),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse's own refusals (an unknown flag, a value outside a flag's choices, a missing argument) as one
    `error:` line and exit 2, like every other bad input; the usage block argparse prints before them buried the
    reason. `--help` shows the usage; the subcommands' parsers are of this class too (argparse makes them so).

    A flag is taken only as written: argparse's abbreviations (`--out` taken as --output-dir, while `--save`, a prefix
    of three flags, was refused) made a typo's meaning depend on which flags exist, and a flag added later would break
    a script's abbreviation; an unknown flag or command names the ones it is closest to instead, as config keys do."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}  # the top level's: each command's parser, by name

    def error(self, message: str):
        listed = "commands" if self.commands else "flags"
        self.exit(2, f"error: {self.prog}: {message} (`{self.prog} --help` lists the {listed})\n")

    def parse_command(self, argv: list[str]) -> argparse.Namespace:
        """`parse_args`, a command's unknown flags refused by that command's parser (argparse's top level refuses
        them as its own: "tuneforge: unrecognized arguments", pointing at the wrong --help)."""
        if self.commands and argv and not argv[0].startswith("-") and argv[0] not in self.commands:
            self.error(f"unknown command {argv[0]!r}{_did_you_mean(argv[0], self.commands, quote=True)}")
        ns, extra = self.parse_known_args(argv)
        command = self.commands.get(ns.command, self)
        listed = _listed_positional(command)
        if listed:
            _reclaim_positionals(command, ns, listed, argv)
        if extra and listed and not any(item.startswith("-") for item in extra):
            # `train CONFIG --max-steps 2 epochs=3`: argparse fills a list positional only before the first flag
            words = [*getattr(ns, listed), *extra]
            setattr(ns, listed, sorted(words, key=lambda word: argv.index(word) if word in argv else -1))
        elif extra:
            flags = [o for action in command._actions for o in action.option_strings if o.startswith("--")]
            unknown = next((item.split("=", 1)[0] for item in extra if item.startswith("--")), "")
            command.error(f"unrecognized arguments: {' '.join(extra)}{_did_you_mean(unknown, flags)}")
        return ns


def _reclaim_positionals(parser: argparse.ArgumentParser, ns: argparse.Namespace, listed: str, argv: list[str]):
    """`train CONFIG --report-to mlflow epochs=2`: a flag of several words (nargs '+') takes every word up to the
    next flag, so an override after it was refused as a tracker's name. Its words that are a key=VALUE override or a
    .yaml config, which no such flag takes, go back to the config positional `listed`, in the order typed."""

    def positional(word) -> bool:
        if not isinstance(word, str):
            return False
        key, equals, _ = word.partition("=")
        return bool(equals and OVERRIDE_KEY.fullmatch(key)) or word.lower().endswith((".yaml", ".yml"))

    for action in parser._actions:
        values = getattr(ns, action.dest, None)
        if action.nargs != argparse.ONE_OR_MORE or not isinstance(values, list):
            continue
        words = [word for word in values if positional(word)]
        if words and len(words) < len(values):  # (a flag left with no word of its own keeps them: refused as is)
            setattr(ns, action.dest, [word for word in values if not positional(word)])
            moved = [*getattr(ns, listed), *words]
            setattr(ns, listed, sorted(moved, key=lambda word: argv.index(word) if word in argv else -1))


def _did_you_mean(given: str, known, quote: bool = False) -> str:
    """'; did you mean --output-dir?' naming what `given` abbreviates (the closest 3 of them), else the one it is a
    near miss of among `known`; '' where nothing is close."""
    known = list(known)
    if not given:
        return ""
    longer = [name for name in known if name.startswith(given)]
    close = difflib.get_close_matches(given, longer, n=3, cutoff=0) or difflib.get_close_matches(given, known, 1, 0.8)
    if not close:
        return ""
    names = [repr(name) if quote else name for name in close]
    return f"; did you mean {' or '.join(names) if len(names) < 3 else f'{names[0]}, {names[1]} or {names[2]}'}?"


def _listed_positional(parser: argparse.ArgumentParser) -> str | None:
    """The dest of `parser`'s positional that takes any number of words (a config and its overrides), if any."""
    found = [a.dest for a in parser._actions if not a.option_strings and a.nargs == argparse.ZERO_OR_MORE]
    return found[0] if found else None


def build_parser(command: str | None = None) -> OneLineParser:
    """The `tuneforge` parser. `command`: the one command whose arguments are built (the others are
    listed with their help: `tuneforge --help` stays instant); None: every command's."""
    parser = OneLineParser(prog="tuneforge", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments) in COMMANDS.items():
        p = parser.commands[name] = sub.add_parser(name, help=help_text)
        if command is None or command == name:
            add_arguments(p)
    return parser


# commands that run a model on given rows or prompts: no `datasets` progress bar (map, load_dataset) is on their
# paths, and importing `datasets` to turn its bars off would cost them a second of start-up
MODEL_RUNNING_COMMANDS = ("predict", "serve", "generate", "chat")


def _quiet_libraries(command: str) -> None:
    """Library chatter (load reports, per-file progress bars) would drown our own lines."""
    import huggingface_hub
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if command not in MODEL_RUNNING_COMMANDS:
        import datasets

        datasets.disable_progress_bars()
    huggingface_hub.utils.logging.set_verbosity_error()
    hide_deepspeed_cpu_notice()


def _internal_error(err: BaseException, argv: list[str]) -> int:
    """An unexpected exception: a bug in tuneforge, not the user's input. One line; the traceback to a file."""
    import datetime
    import os
    import platform
    import tempfile
    import traceback

    from tuneforge import __version__

    first = (str(err).strip().splitlines() or [""])[0][:200]
    what = f"{type(err).__name__}: {first}" if first else type(err).__name__
    report = "".join(
        [
            f"tuneforge {__version__}, python {platform.python_version()}, {platform.platform()}\n",
            f"time: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}\n",
            f"command: tuneforge {' '.join(argv)}\n\n",
            *traceback.format_exception(type(err), err, err.__traceback__),
        ]
    )
    try:
        fd, path = tempfile.mkstemp(prefix="tuneforge-error-", suffix=".txt")
        # an argument with a byte that is not UTF-8 (a lone surrogate in argv) is written as its escape
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:
            fh.write(report)
        where = f"the full traceback is in {path}"
    except OSError:  # nowhere to write it: the traceback goes to stderr after the line
        path, where = None, "the full traceback follows"
    print(
        f"internal error (a bug in tuneforge, not in your input): {what}; {where}; please report it to the "
        "tuneforge issue tracker with that file and the output of `tuneforge env`",
        file=sys.stderr,
        flush=True,
    )
    if path is None:
        print(report, file=sys.stderr, flush=True)
    return 1


def _stopped(stop: KeyboardInterrupt, as_program: bool) -> int:
    """Ctrl-C's line ('interrupted', 130) or a stop signal's ('error: stopped by SIGTERM', 143); the exit status."""
    code = stop.exit_code if isinstance(stop, stops.StoppedBySignal) else 130
    if code == 130:
        print("interrupted", file=sys.stderr, flush=True)
    elif not launch.launched_by_us():  # a worker's launcher says it, once for all of them
        print(f"error: {stop}", file=sys.stderr, flush=True)
    if as_program:
        stops.ignore_further_stops()
    return code


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None  # the process's command (not a call from Python): it ends when this returns
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else "")
    try:
        ns = parser.parse_command(argv)
    except SystemExit as done:  # --help (0), or argparse's one-line refusal (2)
        return done.code if isinstance(done.code, int) else 2
    try:
        _quiet_libraries(ns.command)
        with stops.stopping_as_ctrl_c():
            return ns.func(ns)
    except UserError as err:
        launch.report_user_error(err)  # in a worker we launched: shown once, by the launching process
        return err.exit_code
    except KeyboardInterrupt as stopped:
        return _stopped(stopped, as_program)
    except BrokenPipeError:  # stdout closed early (`tuneforge env | head -1`): not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
    except Exception as err:  # never a bare traceback; never exit 2 (that is the user's mistake)
        if launch.user_error_reported():  # a worker whose peer stopped on a user error: the launcher shows that
            return 1
        return _internal_error(err, argv)


if __name__ == "__main__":
    sys.exit(main())
