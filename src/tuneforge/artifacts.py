"""Model folders' ground floor: tuneforge.json, its one reader and its one writer.

tuneforge.json beside a model's weights (an exported model, an adapter folder, a checkpoint) tells
`predict`/`generate`/`serve`/`export` what the model was trained for: task, text columns, max_length,
source prefix, an adapter's base. Every module reads and writes it through these two functions, so
the file's name and its validation live in one place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tuneforge.errors import ConfigError

MODEL_INFO = "tuneforge.json"


def read_model_info(model_dir: str | os.PathLike) -> dict:
    """tuneforge.json beside a model: task, text columns, max_length ({} if absent)."""
    info_file = Path(model_dir) / MODEL_INFO
    if not info_file.exists():
        return {}
    try:
        info = json.loads(info_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{str(info_file)!r} is not valid JSON ({err}); re-export the model or delete that file"
        ) from None
    if not isinstance(info, dict):
        raise ConfigError(
            f"{str(info_file)!r} is not a JSON object (it holds a {type(info).__name__}); re-export the model or "
            "delete that file"
        )
    return info


def write_model_info(model_dir: str | os.PathLike, info: dict) -> None:
    """tuneforge.json into `model_dir` (a folder being written; its atomic rename is the caller's)."""
    (Path(model_dir) / MODEL_INFO).write_text(json.dumps(info, indent=2))
