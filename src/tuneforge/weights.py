"""Tied weights: one parameter under several names (GPT-2's lm_head.weight is its wte.weight).

safetensors stores such a tensor once, and a gather of sharded weights returns one copy per
name: these helpers map between a model's parameters and all of their names.
"""

from __future__ import annotations

import torch
from torch import nn


def parameter_names(model: nn.Module) -> list[tuple[nn.Parameter, list[str]]]:
    """Each distinct parameter with every name it has, in `model.parameters()` order."""
    found: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(param), (param, []))[1].append(name)
    return list(found.values())


def share_tied(weights: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Give every name of a tied parameter the tensor of the first of its names that `weights`
    holds (in place; returned for convenience): a missing alias is filled in, and aliases gathered
    separately become one tensor again (so `save_pretrained` writes it once)."""
    for _, names in parameter_names(model):
        stored = [n for n in names if n in weights]
        if len(names) > 1 and stored:
            for name in names:
                weights[name] = weights[stored[0]]
    return weights
