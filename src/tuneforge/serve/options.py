"""The server's settings (`ServeOptions`) and the `tuneforge serve` flags that set them: each flag's default is
the field's default, written once here. Imports nothing heavy: the CLI builds its parser from it."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ServeOptions:
    model_dir: str
    served_model_name: str
    max_batch_size: int = 32
    max_wait_ms: float = 10.0
    max_queue: int = 256
    max_request_items: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 600.0
    default_max_tokens: int = 512  # chat completions without max_tokens (completions: 16, as OpenAI)
    api_key: str | None = None


# flag: (its ServeOptions field, its type, its help); the default is the field's
FLAGS = {
    "--max-batch-size": (
        "max_batch_size",
        int,
        "classifiers: most inputs in one batch; generation: most sequences decoding together (1: batching off)",
    ),
    "--max-wait-ms": ("max_wait_ms", float, "classifiers: longest a request waits for others to join"),
    "--max-queue": ("max_queue", int, "most requests (sequences) waiting; beyond it: 503 with Retry-After"),
    "--max-body-bytes": ("max_body_bytes", int, "larger request bodies get 413"),
    "--request-timeout": ("request_timeout_s", float, "seconds a request may take (then 504)"),
    "--default-max-tokens": (
        "default_max_tokens",
        int,
        "a chat completion's max_tokens when the request gives none (completions: 16, as OpenAI)",
    ),
}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeOptions)}


def add_flags(p: argparse.ArgumentParser) -> None:
    for flag, (name, kind, help_text) in FLAGS.items():
        p.add_argument(flag, type=kind, default=DEFAULTS[name], help=help_text)


def from_namespace(ns: argparse.Namespace) -> ServeOptions:
    """The options of parsed `tuneforge serve` arguments."""
    tuned = {name: getattr(ns, flag[2:].replace("-", "_")) for flag, (name, _, _) in FLAGS.items()}
    name = ns.served_model_name or ns.model_dir
    return ServeOptions(model_dir=ns.model_dir, served_model_name=name, api_key=ns.api_key, **tuned)
