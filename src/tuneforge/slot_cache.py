"""The slotted key/value cache of the generation engine's causal batch (running_batch.SlotBatch), and the attention
that reads and writes it.

Each running row owns a *slot*: per layer one buffer [slots, kv_heads, capacity, head_dim] holds the row's keys at
positions 0..length-1 — no padding to the longest row, nothing copied as the rows grow (a step writes one
position), and a row that leaves hands its slot to the last row (one row moved, not the whole cache cut).

One forward pass takes the running rows' next tokens and the newcomers' whole prompts packed into one sequence
[1, tokens]: the linear layers run once for all of them (a newcomer costs no forward pass of its own). The
attention (`slot_attention`, registered with transformers' AttentionInterface under `ATTENTION` and switched on
for the engine's forward passes only, `slot_attention_on`) writes each token's key and value into its row's slot
at its position, then attends: the decoding rows over their slots in one batched call (the query heads that share
a key/value head folded into the query length, so grouped-query models read their keys once), each prompt
causally over itself.

Supported: decoder-only rotary models whose attention goes through AttentionInterface with full attention (no
sliding window, no soft-capping): `supports(model)`. Others use running_batch.CausalBatch.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION = "tuneforge_slots"
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})  # checked by tests/test_slot_cache.py
ROUND = 64  # capacity grows in whole blocks of positions (and doubles), slots in blocks of 8


def supports(model) -> bool:
    """Whether `model` can run on slots: a family above, full attention in every layer, sdpa or eager attention
    (ours replaces it: the same maths), and a forward that keeps chosen logits only."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in FAMILIES:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    layer_types = getattr(config, "layer_types", None) or ()
    if windowed or any(kind != "full_attention" for kind in layer_types):
        return False
    return "logits_to_keep" in inspect.signature(model.forward).parameters


class SlotCache:
    """The buffers, per layer, allocated at the first forward pass that reaches the layer (their shape and dtype
    are those of its keys), grown by `reserve`."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slots = 0
        self.capacity = 0

    def reserve(self, slots: int, length: int) -> None:
        """Room for `slots` rows of `length` positions (existing contents kept)."""
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots = max(self.slots, -(-slots // 8) * 8)
        new_capacity = self.capacity
        if length > self.capacity:
            new_capacity = max(-(-length // ROUND) * ROUND, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for layer, old in buffers.items():
                grown = old.new_zeros((new_slots, old.shape[1], new_capacity, old.shape[3]))
                grown[: self.slots, :, : self.capacity] = old
                buffers[layer] = grown
        self.slots, self.capacity = new_slots, new_capacity

    def layer(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers of a layer whose keys and values look like `key`, `value` [1, kv_heads,
        tokens, head_dim], both in the values' dtype: under autocast the rotary keys come out float32 and the
        values bf16, and the attention would cast the whole cached keys to bf16 at every step (kept so, the same
        numbers once)."""
        if index not in self.keys:
            shape = (self.slots, key.shape[1], self.capacity, key.shape[3])
            self.keys[index] = value.new_zeros(shape)
            self.values[index] = value.new_zeros(shape)
        return self.keys[index], self.values[index]

    def move(self, source: int, target: int, length: int) -> None:
        """Copy slot `source`'s first `length` positions to slot `target` in every layer."""
        for buffers in (self.keys, self.values):
            for buffer in buffers.values():
                buffer[target, :, :length] = buffer[source, :, :length]

    def clear(self) -> None:
        """Give the memory back (the batch is empty)."""
        self.keys.clear()
        self.values.clear()
        self.slots = self.capacity = 0


@dataclass
class Packed:
    """The layout of one forward pass: tokens 0..decoding-1 are the next tokens of slots 0..decoding-1; each
    prompt span (start, end) is a newcomer's whole prompt; every token is written to (slot, position)."""

    cache: SlotCache
    slot: torch.Tensor  # [tokens]
    position: torch.Tensor  # [tokens]
    decoding: int
    decode_mask: torch.Tensor | None  # [decoding, 1, 1, keys]: True where the row has a key (its new one included)
    prompts: list[tuple[int, int]]
    _rows: torch.Tensor | None = None  # each (token, kv head)'s row in a buffer viewed as [rows, dim]

    @property
    def key_length(self) -> int:
        return 0 if self.decode_mask is None else self.decode_mask.shape[-1]

    def write(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        """Write `new` [1, kv_heads, tokens, dim] into `buffer` [slots, kv_heads, capacity, dim] at each token's
        (slot, position): one index_copy_ over the buffer's rows (advanced-index assignment took 8-10x longer)."""
        kv_heads, capacity, dim = buffer.shape[1], buffer.shape[2], buffer.shape[3]
        if self._rows is None:  # the same for every layer of the pass: computed once
            heads = torch.arange(kv_heads, device=self.slot.device)
            self._rows = (
                (self.slot[:, None] * kv_heads + heads[None, :]) * capacity + self.position[:, None]
            ).flatten()
        rows = new[0].transpose(0, 1).reshape(-1, dim)
        buffer.view(-1, dim).index_copy_(0, self._rows, rows.to(buffer.dtype))


def pack(
    cache: SlotCache, lengths: list[int], decoding: int, prompts: list[int], device, slots: list[int] | None = None
) -> Packed:
    """The layout for slots 0..decoding-1 decoding one token each (slot s at position lengths[s]) and prompts of
    these sizes in `slots` (default: the slots after `len(lengths)`, in order); reserves the room they need."""
    first_new = len(lengths)
    slots = list(range(first_new, first_new + len(prompts))) if slots is None else slots
    slot, position, spans, start = list(range(decoding)), lengths[:decoding], [], decoding
    for target, size in zip(slots, prompts):
        slot += [target] * size
        position += range(size)
        spans.append((start, start + size))
        start += size
    mask = None
    if decoding:
        attend = torch.tensor(lengths[:decoding]) + 1
        mask = (torch.arange(int(attend.max()))[None, :] < attend[:, None])[:, None, None, :].to(device)
    cache.reserve(max([first_new - 1, *slots]) + 1, max([*prompts, mask.shape[-1] if mask is not None else 0]))
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return Packed(cache, as_tensor(slot), as_tensor(position), decoding, mask, spans)


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, slot_plan=None, **kwargs):
    """transformers' attention-function signature: query [1, heads, tokens, dim], key and value [1, kv_heads,
    tokens, dim] (rotary applied); returns [1, tokens, heads, dim] (and no weights)."""
    plan: Packed = slot_plan
    keys, values = plan.cache.layer(module.layer_idx, key, value)
    plan.write(keys, key)
    plan.write(values, value)
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    out = []
    if plan.decoding:
        rows, length = plan.decoding, plan.key_length
        grouped = query[0, :, :rows].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, dim)
        attended = F.scaled_dot_product_attention(
            grouped, keys[:rows, :, :length], values[:rows, :, :length], attn_mask=plan.decode_mask, scale=scaling
        )
        out.append(attended.reshape(rows, heads, dim))
    for start, end in plan.prompts:
        attended = F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=True,
            scale=scaling,
            enable_gqa=heads != kv_heads,
        )
        out.append(attended[0].transpose(0, 1))
    return (out[0] if len(out) == 1 else torch.cat(out)).unsqueeze(0), None


_registered = False


@contextlib.contextmanager
def slot_attention_on(model):
    """The model's attention is `slot_attention` for the while (given back after, e.g. to a training step)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION, slot_attention)
        _registered = True
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
