"""The running batch of the generation engine (serve/engine.py), one type per model family (chosen by the
generator's family in generate.py, which sits below serve/): what a forward pass over the running
rows needs: a causal LM's rows on slots (SlotBatch: each row's keys in a slot of its own, newcomers' prompts in the
running rows' pass; the models `slot_cache.supports`) or in one left-padded key/value cache that newcomers join at
any step (CausalBatch: the other causal LMs; one with a recurrent state is refused, `recurrent_state`); a seq2seq
model's encoder outputs and decoder cache, newcomers joining at any step where its decoder's positions are relative
(T5's), else admitted together when the batch is empty (Seq2SeqBatch). Knows nothing
of sampling or requests.
"""

from __future__ import annotations

import inspect

import torch

from tuneforge.errors import ConfigError
from tuneforge.slot_cache import SlotCache, pack, slot_attention_on

# encoder-decoder models whose decoder's positions are relative (T5's buckets of distances): a row may join left-padded
RELATIVE_DECODERS = frozenset({"t5", "mt5"})
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})  # keys per position


def recurrent_state(model) -> str | None:
    """What of `model` keeps a state other than keys and values per position, which a batch here cannot left-pad,
    join or cut (None: nothing): transformers' stateful models (Mamba, RWKV, Jamba...) and layers such as
    LFM2's "conv" or Qwen3-Next's "linear_attention"."""
    config = model.config.get_text_config(decoder=True)
    others = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS)
    if others:
        return f"its {', '.join(others)} layers"
    if getattr(model, "_is_stateful", False):
        return "its layers"
    return None


def _forward_kwarg(model) -> str:
    """The name the model's forward takes its key/value cache by (`cache` from transformers 5.x, before it
    `past_key_values`)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _keeps_logits(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (most causal LMs of transformers): a prefill then runs
    the output layer on the last position only, not over every prompt token."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _output_cache(outputs):
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else outputs.past_key_values


def _cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer, each [batch, heads, length, head_dim]."""
    return [(layer[0], layer[1]) for layer in cache]


def _dynamic_cache(tensors: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    return DynamicCache(tensors)


def _encoder_decoder_cache(selfs: list, crosses: list):
    """An encoder-decoder cache of (keys, values) per layer: its decoder's, its cross-attention's (computed: the
    model reads them, not the encoder outputs, after the first step)."""
    from transformers import EncoderDecoderCache

    return EncoderDecoderCache(_dynamic_cache(selfs), _dynamic_cache(crosses))


def _pad(t: torch.Tensor, width: int, dim: int, left: bool = True) -> torch.Tensor:
    """`t` with `width` zero positions in front of (`left`) or after its dimension `dim`."""
    if width == 0:
        return t
    shape = list(t.shape)
    shape[dim] = width
    pad = t.new_zeros(shape)
    return torch.cat([pad, t] if left else [t, pad], dim=dim)


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` ([batch, heads, length, dim] or [batch, length]) with `width` zero positions in front."""
    if width == 0:
        return t
    shape = list(t.shape)
    dim = 2 if t.dim() == 4 else 1
    shape[dim] = width
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class CausalBatch:
    """The running rows of a causal LM: one left-padded key/value cache; newcomers join at any step."""

    joins_running = True
    fuses_prefill = False  # newcomers are prefilled in a pass of their own (`step` is SlotBatch's)

    def __init__(self, model, pad_id: int) -> None:
        if (state := recurrent_state(model)) is not None:
            raise ConfigError(
                f"a model of the {model.config.model_type} family keeps a state other than a key and value per "
                f"position in {state} (a recurrent state), which the serving engine's batch of key/value caches cannot "
                "hold; "
                "`tuneforge generate` runs it (transformers' generate)"
            )
        self.model = model
        self.pad_id = pad_id
        self.kwarg = _forward_kwarg(model)
        self.keeps_logits = _keeps_logits(model)
        self.device = next(model.parameters()).device
        self.cache = None
        self.mask: torch.Tensor | None = None  # [rows, cached length], 1 where a real token is cached
        self.next_pos: torch.Tensor | None = None  # [rows], the position id of each row's next token

    def prefill(self, prompts: list[list[int]], every_position: bool = False) -> torch.Tensor:
        """Run the prompts (left padded), add them to the batch (after the running rows); their last logits [rows,
        vocab], or (`every_position`: an echoed prompt's log-probs need them) those of every position [rows, width,
        vocab], each prompt ending at the last."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = {"logits_to_keep": 1} if self.keeps_logits and not every_position else {}
        # every position's keys: the model's own cache keeps a sliding-window layer's last few only, which the
        # batch's mask (one column per position) would not match; the model's mask keeps the window
        cache = {self.kwarg: _dynamic_cache([])}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache, **keep)
        self._merge(_output_cache(out), mask)
        return out.logits if every_position else out.logits[:, -1, :]

    def _merge(self, cache, mask: torch.Tensor) -> None:
        new = _cache_tensors(cache)
        if self.cache is None:
            self.cache, self.mask, self.next_pos = _dynamic_cache(new), mask, mask.sum(-1)
            return
        old = _cache_tensors(self.cache)
        length = max(self.mask.shape[1], mask.shape[1])
        a, b = length - self.mask.shape[1], length - mask.shape[1]
        merged = [
            (torch.cat([_pad_left(ko, a), _pad_left(kn, b)]), torch.cat([_pad_left(vo, a), _pad_left(vn, b)]))
            for (ko, vo), (kn, vn) in zip(old, new)
        ]
        self.cache = _dynamic_cache(merged)
        self.mask = torch.cat([_pad_left(self.mask, a), _pad_left(mask, b)])
        self.next_pos = torch.cat([self.next_pos, mask.sum(-1)])

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step: each row's last sampled token in, the next logits [rows, vocab] out."""
        mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        out = self.model(
            input_ids=tokens.to(self.device)[:, None],
            attention_mask=mask,
            position_ids=self.next_pos[:, None],
            use_cache=True,
            **{self.kwarg: self.cache},
        )
        self.cache, self.mask, self.next_pos = _output_cache(out), mask, self.next_pos + 1
        return out.logits[:, -1, :]

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); cut the columns that are padding for all of them."""
        if not rows:
            self.cache = self.mask = self.next_pos = None
            return
        index = torch.tensor(rows, device=self.device)
        mask = self.mask.index_select(0, index)
        used = mask.any(0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        self.cache = _dynamic_cache(
            [
                (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                for k, v in _cache_tensors(self.cache)
            ]
        )
        self.mask, self.next_pos = mask[:, start:], self.next_pos.index_select(0, index)

    def cached_length(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def probe(self) -> None:
        """One token through the model, the batch untouched: raises when the model itself is broken."""
        self.model(input_ids=torch.full((1, 1), self.pad_id, device=self.device), use_cache=False)


class Seq2SeqBatch:
    """The running rows of an encoder-decoder model. A decoder whose positions are relative (T5's, RELATIVE_DECODERS)
    takes newcomers at any step: their encoder outputs (and cross-attention keys) padded on the right to the batch's
    width, their decoder keys on the left, a decoder mask marking each row's real positions (a left-padded row sees
    the same distances as alone). Others (BART's absolute positions, counted from the cache length that every row
    shares) are admitted together when the batch is empty."""

    fuses_prefill = False

    def __init__(self, model, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.kwarg = _forward_kwarg(model)
        self.device = next(model.parameters()).device
        start = model.config.decoder_start_token_id
        if start is None and model.generation_config is not None:
            start = model.generation_config.decoder_start_token_id
        self.start_id = start if start is not None else pad_id
        self.joins_running = model.config.model_type in RELATIVE_DECODERS
        self.cache = self.encoded = self.mask = None
        self.decoder_mask: torch.Tensor | None = None  # joins_running: [rows, decoder length], 1 where real

    def prefill(self, prompts: list[list[int]], every_position: bool = False) -> torch.Tensor:
        """Encode the prompts; the decoder's first logits [rows, vocab]; the rows join the running ones (after
        them). A prompt is read, not continued: it has no log-probs of its own (`every_position` is refused)."""
        if every_position:
            raise ValueError("an encoder-decoder model gives its prompt no log-probs")
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        encoded = self.model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        start = torch.full((len(prompts), 1), self.start_id, dtype=torch.long, device=self.device)
        decoder_mask = torch.ones_like(start) if self.joins_running else None
        logits, cache = self._forward(encoded, mask, start, decoder_mask, None)
        if self.cache is None:
            self.encoded, self.mask, self.cache, self.decoder_mask = encoded, mask, cache, decoder_mask
        else:
            self._merge(encoded, mask, cache, decoder_mask)
        return logits

    def _forward(self, encoded, mask, tokens, decoder_mask, cache):
        """One decoder step: (the next logits [rows, vocab], the cache after it)."""
        out = self.model(
            encoder_outputs=(encoded,),
            attention_mask=mask,
            decoder_input_ids=tokens,
            decoder_attention_mask=decoder_mask,
            use_cache=True,
            **({self.kwarg: cache} if cache is not None else {}),
        )
        return out.logits[:, -1, :], _output_cache(out)

    def _merge(self, encoded, mask, cache, decoder_mask) -> None:
        """Newcomers' encoder outputs, mask and cache after the running rows': the encoder side padded on the right
        to the wider of the two, the decoder side on the left to the longer."""
        width = max(self.mask.shape[1], mask.shape[1])
        a, b = width - self.mask.shape[1], width - mask.shape[1]
        self.encoded = torch.cat([_pad(self.encoded, a, 1, left=False), _pad(encoded, b, 1, left=False)])
        self.mask = torch.cat([_pad(self.mask, a, 1, left=False), _pad(mask, b, 1, left=False)])
        length = max(self.decoder_mask.shape[1], decoder_mask.shape[1])
        c, d = length - self.decoder_mask.shape[1], length - decoder_mask.shape[1]
        self.decoder_mask = torch.cat([_pad(self.decoder_mask, c, 1), _pad(decoder_mask, d, 1)])
        selfs = [
            tuple(torch.cat([_pad(old, c, 2), _pad(new, d, 2)]) for old, new in zip(o, n))
            for o, n in zip(_cache_tensors(self.cache.self_attention_cache), _cache_tensors(cache.self_attention_cache))
        ]
        crosses = [
            tuple(torch.cat([_pad(old, a, 2, left=False), _pad(new, b, 2, left=False)]) for old, new in zip(o, n))
            for o, n in zip(
                _cache_tensors(self.cache.cross_attention_cache), _cache_tensors(cache.cross_attention_cache)
            )
        ]
        self.cache = _encoder_decoder_cache(selfs, crosses)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = self.decoder_mask
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        logits, self.cache = self._forward(self.encoded, self.mask, tokens.to(self.device)[:, None], mask, self.cache)
        self.decoder_mask = mask
        return logits

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); where rows join, cut the columns that are padding for all of them."""
        if not rows:
            self.cache = self.encoded = self.mask = self.decoder_mask = None
            return
        index = torch.tensor(rows, device=self.device)
        self.encoded, self.mask = self.encoded.index_select(0, index), self.mask.index_select(0, index)
        if self.decoder_mask is None:
            self.cache.batch_select_indices(index)
            return
        self.decoder_mask = self.decoder_mask.index_select(0, index)
        first = int(self.decoder_mask.any(0).nonzero()[0])  # the decoder's first column some row still uses
        width = int(self.mask.any(0).nonzero()[-1]) + 1  # the encoder's last
        self.decoder_mask, self.mask, self.encoded = (
            self.decoder_mask[:, first:],
            self.mask[:, :width],
            self.encoded[:, :width],
        )
        selfs = [
            tuple(t.index_select(0, index)[:, :, first:] for t in layer)
            for layer in _cache_tensors(self.cache.self_attention_cache)
        ]
        crosses = [
            tuple(t.index_select(0, index)[:, :, :width] for t in layer)
            for layer in _cache_tensors(self.cache.cross_attention_cache)
        ]
        self.cache = _encoder_decoder_cache(selfs, crosses)

    def cached_length(self) -> int:
        return 0  # the decoder's length is counted per row

    def probe(self) -> None:
        one = torch.full((1, 1), self.pad_id, device=self.device)
        self.model(input_ids=one, decoder_input_ids=torch.full_like(one, self.start_id), use_cache=False)


def shared_prompts(prompts: list[list[int]]) -> dict[int, int]:
    """{i: j} for each prompt i equal to an earlier prompt j (its first copy)."""
    first: dict[tuple[int, ...], int] = {}
    shared = {}
    for i, prompt in enumerate(prompts):
        j = first.setdefault(tuple(prompt), i)
        if j != i:
            shared[i] = j
    return shared


class SlotBatch:
    """The running rows of a causal LM on slots (tuneforge/slot_cache.py): each row's keys in a slot of its own,
    newcomers' prompts packed into the same forward pass as the running rows' next tokens (`step`)."""

    joins_running = True
    fuses_prefill = True

    def __init__(self, model, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.cache = SlotCache()
        self.lengths: list[int] = []  # per slot: the positions it holds
        self.slot_of_row: list[int] = []  # the engine's row i is in slot slot_of_row[i]

    def prefill(self, prompts: list[list[int]], every_position: bool = False) -> torch.Tensor:
        """As CausalBatch.prefill: the prompts join (after the running rows); their last logits, or every
        position's [rows, width, vocab], each prompt ending at the last."""
        return self.step(None, prompts, every_position)[1]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.step(tokens, [], False)[0]

    def step(self, tokens, prompts: list[list[int]], every_position: bool = False):
        """One forward pass: each running row's last token (`tokens`, in row order; None: the rows wait) and the
        newcomers' prompts. Returns (the rows' next logits [rows, vocab] or None, the prompts' logits as `prefill`
        gives them or None). Nothing is kept unless the pass succeeds."""
        decoding = 0 if tokens is None else len(self.slot_of_row)
        ids = [0] * decoding
        last = tokens.tolist() if decoding else []  # one copy to the host, not one per row
        for row, slot in enumerate(self.slot_of_row[:decoding]):
            ids[slot] = last[row]
        # a prompt given more than once (GRPO's group, OpenAI's n) is computed once, its keys copied after
        first_new, shared = len(self.lengths), {} if every_position else shared_prompts(prompts)
        computed = [i for i in range(len(prompts)) if i not in shared]
        for i in computed:
            ids += prompts[i]
        slots = [first_new + i for i in computed]
        self.cache.reserve(first_new + len(prompts), 0)  # the copies' slots too (allocated with the layers)
        plan = pack(self.cache, self.lengths, decoding, [len(prompts[i]) for i in computed], self.device, slots)
        ends = [end - 1 for _, end in plan.prompts]
        keep = list(range(decoding)) + (list(range(decoding, len(ids))) if every_position else ends)
        with slot_attention_on(self.model):
            logits = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=plan.position[None, :],
                use_cache=False,
                logits_to_keep=torch.tensor(keep, device=self.device),
                slot_plan=plan,
            ).logits[0]
        decoded = logits[torch.tensor(self.slot_of_row, device=logits.device)] if decoding else None
        prefilled = self._prompt_logits(logits[decoding:], plan, every_position) if prompts else None
        if shared:
            for i, source in shared.items():
                self.cache.move(first_new + source, first_new + i, len(prompts[i]))
            order = [computed.index(shared.get(i, i)) for i in range(len(prompts))]
            prefilled = prefilled[torch.tensor(order, device=prefilled.device)]
        for slot in range(decoding):
            self.lengths[slot] += 1
        self.slot_of_row += range(len(self.lengths), len(self.lengths) + len(prompts))
        self.lengths += [len(p) for p in prompts]
        return decoded, prefilled

    @staticmethod
    def _prompt_logits(logits: torch.Tensor, plan, every_position: bool) -> torch.Tensor:
        if not every_position:
            return logits
        first = plan.prompts[0][0]
        width = max(end - start for start, end in plan.prompts)
        out = logits.new_zeros((len(plan.prompts), width, logits.shape[-1]))
        for i, (start, end) in enumerate(plan.prompts):
            out[i, width - (end - start) :] = logits[start - first : end - first]
        return out

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); the slots of rows that left go to the last rows (moved)."""
        if not rows:
            self.cache.clear()
            self.lengths, self.slot_of_row = [], []
            return
        kept = [self.slot_of_row[i] for i in rows]
        holes = sorted(set(range(len(kept))) - set(kept))
        movers = {slot: holes.pop(0) for slot in sorted(kept) if slot >= len(kept)}
        for source, target in movers.items():
            self.cache.move(source, target, self.lengths[source])
        lengths = [0] * len(kept)
        for slot in kept:
            lengths[movers.get(slot, slot)] = self.lengths[slot]
        self.slot_of_row = [movers.get(slot, slot) for slot in kept]
        self.lengths = lengths

    def cached_length(self) -> int:
        return max(self.lengths, default=0)

    def probe(self) -> None:
        self.model(input_ids=torch.full((1, 1), self.pad_id, device=self.device), use_cache=False)
