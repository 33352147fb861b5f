"""`tuneforge` command line: train, eval, predict, export, generate, serve, download, env.

Every user error ends with one line on stderr and exit code 2; a failed worker with exit 1. Anything
else is a bug in tuneforge: one line on stderr saying so and where its traceback was written, exit 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any

from tuneforge import launch
from tuneforge.errors import UserError

# flag -> (config key, argparse kwargs). Flags left unset do not override YAML/defaults.
TRAIN_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--task": ("task", {}),
    "--model": ("model", {}),
    "--output-dir": ("output_dir", {}),
    "--overwrite": ("overwrite", {"action": "store_const", "const": True}),
    "--epochs": ("epochs", {"type": float}),
    "--max-steps": ("max_steps", {"type": int}),
    "--batch-size": ("batch_size", {"type": int, "help": "per process"}),
    "--eval-batch-size": ("eval_batch_size", {"type": int}),
    "--grad-accum": ("grad_accum", {"type": int}),
    "--seed": ("seed", {"type": int}),
    "--precision": ("precision", {"choices": ["auto", "fp32", "bf16", "fp16"]}),
    "--gradient-checkpointing": ("gradient_checkpointing", {"action": "store_const", "const": True}),
    "--dropout": (
        "dropout",
        {
            "type": float,
            "help": "every dropout probability of the model (default 0; dropout=null keeps the model's own)",
        },
    ),
    "--attn-implementation": ("attn_implementation", {"help": "auto (default), eager, sdpa, flash_attention_2, ..."}),
    "--eval-strategy": ("eval_strategy", {"choices": ["epoch", "steps", "no"]}),
    "--eval-steps": ("eval_steps", {"type": int}),
    "--logging-steps": ("logging_steps", {"type": int}),
    "--metric-for-best": ("metric_for_best", {}),
    "--early-stopping-patience": ("early_stopping_patience", {"type": int}),
    "--load-best-model-at-end": ("load_best_model_at_end", {"action": "store_const", "const": True}),
    "--num-beams": ("num_beams", {"type": int}),
    "--generation-max-length": ("generation_max_length", {"type": int}),
    "--save-strategy": ("save_strategy", {"choices": ["epoch", "steps", "no"]}),
    "--save-steps": ("save_steps", {"type": int}),
    "--save-total-limit": ("save_total_limit", {"type": int}),
    "--resume": ("resume", {"nargs": "?", "const": "latest", "help": "latest (default) or a checkpoint folder"}),
    "--backend": ("backend", {}),
    "--nproc": ("nproc", {"type": int}),
    "--nnodes": ("nnodes", {"type": int}),
    "--node-rank": ("node_rank", {"type": int}),
    "--master-addr": ("master_addr", {}),
    "--master-port": ("master_port", {"type": int}),
    "--rdzv-endpoint": ("rdzv_endpoint", {}),
    "--hostfile": ("hostfile", {}),
    "--max-restarts": ("max_restarts", {"type": int}),
    "--zero-stage": ("zero_stage", {"type": int}),
    "--offload": ("offload", {"choices": ["none", "optimizer", "params", "both"]}),
    "--deepspeed-config": ("deepspeed_config", {}),
    "--tp-size": ("tp_size", {"type": int}),
    "--quiet": ("quiet", {"action": "store_const", "const": True}),
    "--report-to": ("report_to", {"nargs": "+", "choices": ["jsonl", "tensorboard"]}),
    "--lr": ("optim.lr", {"type": float}),
    "--weight-decay": ("optim.weight_decay", {"type": float}),
    "--scheduler": ("optim.scheduler", {"choices": ["linear", "cosine", "constant", "constant_with_warmup"]}),
    "--warmup-steps": ("optim.warmup_steps", {"type": int}),
    "--warmup-ratio": ("optim.warmup_ratio", {"type": float}),
    "--max-grad-norm": ("optim.max_grad_norm", {"type": float}),
    "--data-dir": ("data.data_dir", {}),
    "--train-file": ("data.train_file", {}),
    "--validation-file": ("data.validation_file", {}),
    "--text-column": ("data.text_columns", {"action": "append", "help": "once or twice (sentence pairs)"}),
    "--label-column": ("data.label_column", {}),
    "--source-file": ("data.source_file", {}),
    "--target-file": ("data.target_file", {}),
    "--validation-source-file": ("data.validation_source_file", {}),
    "--validation-target-file": ("data.validation_target_file", {}),
    "--source-column": ("data.source_column", {}),
    "--target-column": ("data.target_column", {}),
    "--source-prefix": ("data.source_prefix", {}),
    "--max-length": ("data.max_length", {"type": int}),
    "--max-target-length": ("data.max_target_length", {"type": int}),
    "--block-size": ("data.block_size", {"type": int}),
    "--no-packing": ("data.packing", {"action": "store_const", "const": False}),
    "--max-train-samples": ("data.max_train_samples", {"type": int}),
    "--max-eval-samples": ("data.max_eval_samples", {"type": int}),
    "--no-group-by-length": ("data.group_by_length", {"action": "store_const", "const": False}),
    "--cache-dir": ("data.cache_dir", {}),
}

EVAL_FLAGS = {
    k: TRAIN_FLAGS[k]
    for k in (
        "--task",
        "--data-dir",
        "--train-file",
        "--validation-file",
        "--text-column",
        "--label-column",
        "--source-file",
        "--target-file",
        "--validation-source-file",
        "--validation-target-file",
        "--source-column",
        "--target-column",
        "--source-prefix",
        "--max-length",
        "--max-target-length",
        "--block-size",
        "--no-packing",
        "--max-eval-samples",
        "--batch-size",
        "--eval-batch-size",
        "--precision",
        "--seed",
        "--backend",
        "--nproc",
        "--num-beams",
        "--generation-max-length",
        "--quiet",
        "--cache-dir",
    )
}


def _add_flags(parser: argparse.ArgumentParser, table: dict) -> None:
    for flag, (key, kwargs) in table.items():
        parser.add_argument(flag, dest=key, default=None, **kwargs)


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
        print(json.dumps(result), flush=True)


# ---- commands ------------------------------------------------------------------------------
def cmd_train(ns: argparse.Namespace) -> int:
    from tuneforge.config import config_from_sources
    from tuneforge.trainer import Trainer

    yaml_path, overrides = _split_positionals(ns.config)
    flags = _flags(ns, TRAIN_FLAGS)
    if "task" not in flags and not yaml_path and not any(o.startswith("task=") for o in overrides):
        if flags.get("data.source_file"):
            flags["task"] = "seq2seq"
        elif flags.get("data.train_file"):
            flags["task"] = "clm" if str(flags["data.train_file"]).endswith(".txt") else "classification"
    config = config_from_sources(yaml_path, overrides, flags)
    result = Trainer(config).fit()
    if not result or not launch.prints_result():  # a non-main node, or a worker (its launcher prints)
        return 0
    shown = {k: v for k, v in result.items() if isinstance(v, float) and k not in ("wall_s",)}
    headline = (
        None
        if config.quiet and ns.json
        else (
            "final: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()) + f"\nmodel saved to {result['model_dir']}"
        )
    )
    _emit(result, ns.json, headline)
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from tuneforge.config import build_config
    from tuneforge.trainer import Trainer

    flags = _flags(ns, EVAL_FLAGS)
    flags["quiet"] = flags.get("quiet", False)
    values: dict[str, Any] = {}
    for key, value in flags.items():
        section, _, name = key.rpartition(".")
        (values.setdefault(section, {}) if section else values)[name or key] = value
    values["model"] = ns.model_dir
    values["output_dir"] = ns.output_dir or "runs/eval"
    config = build_config(values)
    metrics = Trainer(config).validate()
    if not metrics or not launch.prints_result():
        return 0
    if not ns.json or not config.quiet:
        print(", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()), flush=True)
    _emit(metrics, ns.json)
    return 0


def cmd_predict(ns: argparse.Namespace) -> int:
    from tuneforge.predict import predict_file

    n = predict_file(
        ns.model_dir,
        ns.input,
        ns.output,
        text_columns=ns.text_column,
        batch_size=ns.batch_size,
        max_length=ns.max_length,
    )
    print(f"wrote {n} predictions to {ns.output}", flush=True)
    return 0


def cmd_env(ns: argparse.Namespace) -> int:
    from tuneforge.environment import collect_env, format_env

    info = collect_env()
    print(json.dumps(info, indent=2) if ns.json else format_env(info), flush=True)
    return 0


def _optional(module: str, name: str) -> Callable[[argparse.Namespace], int] | None:
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tuneforge", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="fine-tune a model (config file, key=value overrides, flags)")
    p.add_argument("config", nargs="*", help="optional YAML config, then key=value overrides (optim.lr=3e-5)")
    _add_flags(p, TRAIN_FLAGS)
    p.add_argument("--json", action="store_true", help="last stdout line: the final metrics as JSON")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a model on a task's validation data")
    p.add_argument("model_dir", nargs="?", default=None, help="HF model folder (default: the task's bundled model)")
    _add_flags(p, EVAL_FLAGS)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("predict", help="predict labels for a csv/tsv/jsonl file")
    p.add_argument("model_dir")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--text-column", action="append", default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None)
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("env", help="versions, devices, launcher and usable backends (for bug reports)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env)

    # commands contributed by other modules (each registers its own parser)
    for module in ("tuneforge.export_cli", "tuneforge.generate", "tuneforge.serve", "tuneforge.download"):
        register = _optional(module, "register_cli")
        if register:
            register(sub)
    return parser


def _quiet_libraries() -> None:
    """Library chatter (load reports, per-file progress bars) would drown our own lines."""
    import logging

    import datasets
    import huggingface_hub
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    huggingface_hub.utils.logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


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
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    try:
        _quiet_libraries()
        return ns.func(ns)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`tuneforge env | head -1`): not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
    except Exception as err:  # never a bare traceback; never exit 2 (that is the user's mistake)
        return _internal_error(err, argv)


if __name__ == "__main__":
    sys.exit(main())
