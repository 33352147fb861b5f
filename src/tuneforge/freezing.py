"""Which parameters train: the embeddings alone, or with the bottom transformer layers, can be kept fixed.

Autograd computes no gradient below the lowest parameter that trains, so freezing the embeddings
and the bottom N layers skips their whole backward (on CPU the GEMMs are nearly all of a step:
benchmarks/README.md), and the optimizer has fewer parameters to update.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn


class Frozen(NamedTuple):
    layers: int  # bottom blocks kept fixed
    of: int | None  # blocks in the model's stack (None: no stack found)
    embeddings: bool = False  # the embeddings kept fixed


def transformer_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of transformer blocks, bottom first: the longest ModuleList of blocks of
    one class (of equally long ones the first: an encoder-decoder's encoder). None when there is none."""
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    return best


def freeze_bottom(model: nn.Module, n_layers: int, *, embeddings: bool = False) -> Frozen:
    """Keep the bottom `n_layers` transformer blocks fixed and, when `embeddings` or any layer is
    frozen, the embeddings (every parameter with 'embed' in its name, and the input embeddings):
    training them under fixed layers would run the whole backward again. Returns what was frozen
    (at most all layers; a model without a block stack freezes its embeddings only) and of how many."""
    layers = transformer_layers(model)
    of = len(layers) if layers is not None else None
    if n_layers <= 0 and not embeddings:
        return Frozen(0, of)
    for name, param in model.named_parameters():
        if "embed" in name.lower():
            param.requires_grad_(False)
    input_embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if input_embeddings is not None:  # named otherwise in some models (T5: shared)
        input_embeddings.requires_grad_(False)
    frozen = list(layers)[: max(n_layers, 0)] if layers is not None else []
    for block in frozen:
        block.requires_grad_(False)
    return Frozen(len(frozen), of, embeddings=True)
