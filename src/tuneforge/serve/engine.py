"""The generation engine of `tuneforge serve`: continuous batching of text generation in one thread.

One background thread owns the model. It keeps a *running batch* of sequences and loops:

1. admit waiting sequences (first come, first served) while the batch holds fewer than `max_batch_size` rows:
   their prompts run through the model together (prefill, left padded), each samples its first token;
2. one decode step for every running row: one forward pass over the batch, one token per row, each row
   with its own sampling parameters (temperature, top_p, seed) and stop conditions (end of sequence,
   `max_tokens`, stop strings, the model's context);
3. finished or cancelled rows leave the batch.

**Causal LMs join at the next step**: the running batch holds one key/value cache, left padded to a
common length, with an attention mask marking each row's real positions and explicit position ids.
A prefilled newcomer's cache is padded on the left to the batch's length (or the batch's to the
newcomer's) and concatenated along the batch dimension; a row that leaves is dropped from the cache,
and columns that became padding for every row are cut. **Seq2seq models join at the next batch**:
their rows also carry encoder outputs of different lengths and a decoder that may use absolute
positions, so waiting requests are admitted when the running batch is empty (rows still leave as
they finish).

The engine knows nothing of HTTP or asyncio: each `Sequence` carries an `emit(text, finish_reason)`
callback that the engine calls from its thread with each new piece of text (held back while it may be
the start of a stop string, or an incomplete character), and once with the reason it finished
("stop", "length", "cancelled", or "error"). The waiting list is bounded: `submit` raises `QueueFull`.

**A request fails alone.** Sampling runs row by row: a row whose sampling fails finishes with "error" and the
others go on. A prefill that fails for a group is retried with its first sequence alone (the others go back to
the front of the waiting list): a sequence whose prefill fails alone finishes with "error". A failed decode
step finishes the rows that shared it. After each such failure the engine checks itself with a one-token
forward pass (`probe`): if that fails too, the model itself is broken, and the engine dies: `error` is set,
every open sequence finishes with "error", and `on_death(err)` is called (the server exits, so that a
supervisor restarts it, rather than live on answering nothing).
"""

from __future__ import annotations

import collections
import inspect
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)
SAMPLING_EPS = 1e-5  # a temperature below it samples greedily (vLLM's _SAMPLING_EPS): dividing by it overflows


class EngineDied(Exception):
    """The model failed a forward pass that no request can be blamed for: the engine stops."""


class QueueFull(Exception):
    """The waiting list is full: the caller should answer 503 and ask the client to retry."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(eq=False)
class Sequence:
    """One generated text: its prompt, its parameters, what it has produced so far."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[str, str | None], None]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the decoded generated text (cut at a stop string once finished)
    sent: int = 0  # characters of `text` already emitted
    finish_reason: str | None = None
    cancelled: bool = False
    generator: torch.Generator | None = None

    def cancel(self) -> None:
        """Called from any thread: the engine drops the row at its next step."""
        self.cancelled = True


def _forward_kwarg(model) -> str:
    """The name the model's forward takes its key/value cache by (`cache` from transformers 5.x, before it
    `past_key_values`)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(outputs):
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else outputs.past_key_values


def _cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer, each [batch, heads, length, head_dim]."""
    return [(layer[0], layer[1]) for layer in cache]


def _dynamic_cache(tensors: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    return DynamicCache(tensors)


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

    def __init__(self, model, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.kwarg = _forward_kwarg(model)
        self.device = next(model.parameters()).device
        self.cache = None
        self.mask: torch.Tensor | None = None  # [rows, cached length], 1 where a real token is cached
        self.next_pos: torch.Tensor | None = None  # [rows], the position id of each row's next token

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Run the prompts (left padded), add them to the batch (after the running rows); their last logits."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        self._merge(_output_cache(out), mask)
        return out.logits[:, -1, :]

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
    """The running rows of an encoder-decoder model: admitted together when the batch is empty."""

    joins_running = False

    def __init__(self, model, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.kwarg = _forward_kwarg(model)
        self.device = next(model.parameters()).device
        start = model.config.decoder_start_token_id
        if start is None and model.generation_config is not None:
            start = model.generation_config.decoder_start_token_id
        self.start_id = start if start is not None else pad_id
        self.cache = self.encoded = self.mask = None

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        ids, self.mask = ids.to(self.device), mask.to(self.device)
        self.encoded = self.model.get_encoder()(input_ids=ids, attention_mask=self.mask).last_hidden_state
        start = torch.full((len(prompts),), self.start_id, dtype=torch.long)
        self.cache = None
        return self.decode(start)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        cache = {self.kwarg: self.cache} if self.cache is not None else {}
        out = self.model(
            encoder_outputs=(self.encoded,),
            attention_mask=self.mask,
            decoder_input_ids=tokens.to(self.device)[:, None],
            use_cache=True,
            **cache,
        )
        self.cache = _output_cache(out)
        return out.logits[:, -1, :]

    def keep(self, rows: list[int]) -> None:
        if not rows:
            self.cache = self.encoded = self.mask = None
            return
        index = torch.tensor(rows, device=self.device)
        self.cache.batch_select_indices(index)
        self.encoded, self.mask = self.encoded.index_select(0, index), self.mask.index_select(0, index)

    def cached_length(self) -> int:
        return 0  # the decoder's length is counted per row

    def probe(self) -> None:
        one = torch.full((1, 1), self.pad_id, device=self.device)
        self.model(input_ids=one, decoder_input_ids=torch.full_like(one, self.start_id), use_cache=False)


def sample(logits: torch.Tensor, rows: Seq[Sequence]) -> list[int | None]:
    """One token per row (None for a row whose sampling failed: it fails alone): greedy where the temperature
    is below SAMPLING_EPS, else temperature + nucleus (top_p) sampling with the row's own random generator."""
    logits = logits.float()
    greedy = logits.argmax(-1).tolist()
    out: list[int | None] = []
    for i, seq in enumerate(rows):
        if seq.params.temperature < SAMPLING_EPS:  # NaN is not below it: it fails in sample_row, alone
            out.append(greedy[i])
            continue
        try:
            out.append(sample_row(logits[i], seq.params, seq.generator))
        except Exception as err:
            log.warning("sampling failed for one sequence (%s: %s); the others go on", type(err).__name__, err)
            out.append(None)
    return out


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if not torch.isfinite(probs).all():
        raise ValueError(f"temperature {params.temperature!r} makes the probabilities non-finite")
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # the most likely token always stays
        sorted_probs[outside] = 0
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


class GenerationEngine:
    """Continuous batching over a `tuneforge.generate.Generator`'s model and tokenizer (see the module doc)."""

    def __init__(
        self,
        generator,
        max_batch_size: int = 32,
        max_queue: int = 256,
        context: int | None = None,
        on_step: Callable[[int], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.tokenizer = generator.tokenizer
        self.model = generator.model
        self.family = generator.family
        self.context = context
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.on_step = on_step or (lambda rows: None)  # called with the rows of each forward pass
        self.on_death = on_death  # called once, from the engine thread, if it dies (else the death is logged)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        batch_class = Seq2SeqBatch if self.family == "seq2seq" else CausalBatch
        self.batch = batch_class(self.model, pad)
        self.eos_ids = self._eos_ids()
        self.running: list[Sequence] = []
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) of recent steps
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _eos_ids(self) -> set[int]:
        ids = set()
        config = getattr(self.model, "generation_config", None)
        for source in (getattr(config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(x) for x in source)
        return ids

    # ---- the caller's side (any thread) ------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tuneforge-generate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish what runs and waits, then end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one request; QueueFull when the waiting list cannot take them, EngineDied once
        the engine has stopped."""
        with self._wake:
            if self.error is not None:  # nothing would ever take them
                raise EngineDied(f"the generation engine has stopped: {self.error}")
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"{len(self.waiting)} sequences are waiting already (the limit is {self.max_queue})")
            for seq in seqs:
                if seq.params.seed is not None or seq.params.temperature >= SAMPLING_EPS:
                    seq.generator = torch.Generator(device=self.batch.device)
                    if seq.params.seed is not None:
                        seq.generator.manual_seed(seq.params.seed)
                    else:
                        seq.generator.seed()
            self.waiting.extend(seqs)
            self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running_rows(self) -> int:
        return len(self.running)

    def tokens_per_second(self, window_s: float = 10.0) -> float:
        """Generated tokens per second over the last `window_s` seconds."""
        now = time.monotonic()
        recent = [n for t, n in list(self._recent) if now - t <= window_s]
        return sum(recent) / window_s

    # ---- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._wake:
                        while not self.waiting and not self.running and not self._stopping:
                            self._wake.wait()
                        if self._stopping and not self.waiting and not self.running:
                            return
                        admitted = self._admit()
                    if admitted:
                        self._prefill(admitted)
                    self._drop_finished()
                    if self.running:
                        self._decode()
                        self._drop_finished()
        except BaseException as err:  # the model itself failed (or a bug here): every open request learns of it
            with self._wake:  # with the lock: `submit` takes nothing more once the error is set
                self.error = err
                pending = self.running + list(self.waiting)
                self.waiting.clear()
            self.running = []
            for seq in pending:
                if seq.finish_reason is None:
                    seq.finish_reason = "error"
                    seq.emit("", "error")
            if self.on_death is not None:
                self.on_death(err)
            else:
                log.error("the generation engine stopped: %s: %s", type(err).__name__, err)

    def _admit(self) -> list[Sequence]:
        if not self.batch.joins_running and self.running:
            return []
        room = self.max_batch_size - len(self.running)
        admitted = []
        while self.waiting and len(admitted) < room:
            seq = self.waiting.popleft()
            if seq.cancelled:
                seq.finish_reason = "cancelled"
                seq.emit("", "cancelled")
                continue
            admitted.append(seq)
        return admitted

    def _prefill(self, seqs: list[Sequence]) -> None:
        try:
            logits = self.batch.prefill([s.prompt_ids for s in seqs])
        except Exception as err:
            if len(seqs) > 1:  # find the sequence to blame: the first alone, the rest back to the front
                with self._wake:
                    self.waiting.extendleft(reversed(seqs[1:]))
                self._prefill(seqs[:1])
                return
            self._fail(seqs, err, "prefill")
            return
        self.on_step(len(seqs))
        self.prompt_tokens += sum(len(s.prompt_ids) for s in seqs)
        self.running.extend(seqs)
        self._advance(seqs, sample(logits, seqs))

    def _decode(self) -> None:
        last = torch.tensor([s.token_ids[-1] for s in self.running])
        try:
            logits = self.batch.decode(last)
        except Exception as err:  # the rows that shared the step fail; the batch starts afresh
            failed, self.running = self.running, []
            self.batch.keep([])
            self._fail(failed, err, "decode step")
            return
        self.on_step(len(self.running))
        self._advance(self.running, sample(logits, self.running))

    def _fail(self, seqs: list[Sequence], err: Exception, where: str) -> None:
        """Finish `seqs` with "error"; then the one-token probe: if the model fails it too, the engine dies."""
        log.warning("a %s failed for %d sequence(s) (%s: %s)", where, len(seqs), type(err).__name__, err)
        for seq in seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
                seq.emit("", "error")
        try:
            self.batch.probe()
        except Exception as probe_err:
            raise EngineDied(f"the model fails even a one-token forward pass: {probe_err}") from probe_err

    def _advance(self, seqs: list[Sequence], tokens: list[int]) -> None:
        self.generated_tokens += len(seqs)
        self._recent.append((time.monotonic(), len(seqs)))
        while self._recent and time.monotonic() - self._recent[0][0] > 60:
            self._recent.popleft()
        for seq, token in zip(seqs, tokens):
            if seq.finish_reason is not None:
                continue
            if token is None:  # its sampling failed: it alone ends
                seq.finish_reason = "error"
                seq.emit("", "error")
                continue
            if token in self.eos_ids:
                self._finish(seq, "stop")
                continue
            seq.token_ids.append(token)
            self._update_text(seq)
            if seq.finish_reason is not None:
                continue
            # the positions used: a causal LM's prompt and continuation; a seq2seq decoder's own tokens
            used = len(seq.token_ids) + (len(seq.prompt_ids) if self.family != "seq2seq" else 0)
            if len(seq.token_ids) >= seq.params.max_tokens or (self.context and used >= self.context):
                self._finish(seq, "length")

    def _update_text(self, seq: Sequence) -> None:
        seq.text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        stops = seq.params.stop
        if stops:
            start = max(0, seq.sent - max(map(len, stops)))
            hits = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
            if hits:
                seq.text = seq.text[: max(min(hits), seq.sent)]
                self._finish(seq, "stop")
                return
        ready = len(seq.text.rstrip("\ufffd"))  # a trailing part of a character waits for the rest of its bytes
        hold = 0  # an ending that may grow into a stop string waits too
        for s in stops:
            for k in range(min(len(s) - 1, ready), 0, -1):
                if seq.text[ready - k : ready] == s[:k]:
                    hold = max(hold, k)
                    break
        ready -= hold
        if ready > seq.sent:
            seq.emit(seq.text[seq.sent : ready], None)
            seq.sent = ready

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        rest = seq.text[seq.sent :]
        seq.sent = len(seq.text)
        seq.emit(rest, reason)

    def _drop_finished(self) -> None:
        for seq in self.running:
            if seq.cancelled and seq.finish_reason is None:
                seq.finish_reason = "cancelled"
                seq.emit("", "cancelled")
        keep = [i for i, s in enumerate(self.running) if s.finish_reason is None]
        if len(keep) < len(self.running):
            self.batch.keep(keep)
            self.running = [self.running[i] for i in keep]
