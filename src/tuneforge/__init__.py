"""tuneforge: fine-tune, evaluate and serve Hugging Face transformer models."""

from tuneforge.config import DataConfig, OptimConfig, TrainConfig
from tuneforge.configure import build_config
from tuneforge.errors import UserError

__version__ = "0.1.0"

__all__ = ["TrainConfig", "OptimConfig", "DataConfig", "build_config", "Trainer", "Callback", "UserError"]


def __getattr__(name):  # lazy: importing the package should not import torch
    if name in ("Trainer", "Callback"):
        from tuneforge import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
