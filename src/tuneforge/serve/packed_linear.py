"""A served model's linear layers on oneDNN's packed weights, where this CPU computes them faster that way.

A decode step multiplies a few dozen rows by every weight of the model; so does a predictor's forward of a text or
two (MiniLM in bf16 on one thread: one short text 7.9 -> 6.8 ms with the 12 of its 37 layers judged faster packed at
32 rows; a hand-run probe, not kept). PyTorch's `nn.Linear` on a CPU calls the BLAS, which is slow for some of
those shapes: SmolLM2-135M's output layer (576 -> 49,152) took 34.7 ms a step at 32 rows in fp32 on 2 AVX2 cores,
18.2 ms from a oneDNN-packed copy of its weight (benchmarks/engine_packed.py). Which shapes gain depends on the
CPU and the dtype (its 576 x 576 gained 4%, its 576 -> 192 lost; an earlier hand check found nothing gained for
bf16 on AMX), so `pack_linear_layers` times each distinct weight shape once, both ways, at the serving batch's
rows, and swaps in `PackedLinear` only where packed is clearly faster. Inference only (no autograd), CPU only,
plain `nn.Linear` only (quantized and adapter layers keep theirs); the swapped module drops its unpacked weight (a
weight tied to the embeddings stays there), keeping a stand-in that tells its dtype and shape.
"""

from __future__ import annotations

import time

import torch

FASTER = 0.9  # packed must take at most this share of the plain layer's time (timing noise is ~5%)


class PackedLinear(torch.nn.Module):
    """`linear`'s forward on a oneDNN-packed copy of its weight (laid out for `rows`-row inputs; any row count
    works)."""

    def __init__(self, linear: torch.nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach().to(self.dtype)
        # the dropped weight's dtype and shape, which models read (T5 casts its input to `wo.weight.dtype`); on the
        # meta device, holding no numbers: a computation with it fails rather than answers wrong
        self.weight = torch.empty(linear.weight.shape, dtype=self.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weight's dtype in and out, as autocast runs a linear layer whose weight a predictor keeps in bf16 (this
        # op is not one autocast casts for)
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")


def fastest_time(fn, calls: int = 5) -> float:
    """The shortest of `calls` timed calls of `fn`, after one untimed."""
    fn()  # warm-up (oneDNN builds its kernel on the first call)
    best = float("inf")
    for _ in range(calls):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def packs_faster(linear: torch.nn.Linear, rows: int) -> bool:
    """Whether `rows` rows through this layer run clearly faster on its packed weight (timed here, now)."""
    x = torch.randn(rows, linear.in_features, dtype=linear.weight.dtype)
    try:
        packed = PackedLinear(linear, rows)
        with torch.inference_mode():
            return fastest_time(lambda: packed(x)) < FASTER * fastest_time(lambda: linear(x))
    except RuntimeError:  # a dtype or shape this oneDNN build does not pack
        return False


def pack_linear_layers(model: torch.nn.Module, rows: int, faster=packs_faster) -> int:
    """Swap every plain `nn.Linear` of a CPU model whose weight shape runs faster packed (`faster(layer, rows)`,
    asked once per shape) for a `PackedLinear`; returns how many were swapped (0 off the CPU, without oneDNN, or
    for a peft model)."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return 0
    if getattr(model, "peft_config", None) is not None:
        return 0
    verdicts: dict[tuple, bool] = {}
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or child.weight.dtype not in (torch.float32, torch.bfloat16):
                continue
            shape = (child.in_features, child.out_features, child.weight.dtype, child.bias is not None)
            if shape not in verdicts:
                verdicts[shape] = faster(child, rows)
            if verdicts[shape]:
                setattr(module, name, PackedLinear(child, rows))
                swapped += 1
    return swapped
