"""The generation engine of `tuneforge serve`: continuous batching of text generation in one thread.

One background thread owns the model. It keeps a *running batch* of sequences and loops:

1. admit waiting sequences (first come, first served) while the batch holds fewer than `max_batch_size` rows:
   their prompts run through the model together (prefill, left padded), each samples its first token;
2. one decode step for every running row: one forward pass over the batch, one token per row, each row
   with its own sampling parameters (temperature, top_p, top_k, min_p, penalties, logit_bias, seed:
   serve/logit_rules.py) and stop conditions (end of sequence unless ignore_eos, min_tokens,
   `max_tokens`, stop strings, the model's context);
3. finished or cancelled rows leave the batch.

**Causal LMs join at the next step** (tuneforge/running_batch.py). On slots (SlotBatch, Llama-family models:
tuneforge/slot_cache.py) each row's keys have a slot of their own, and the admitted prompts run in the same
forward pass as the running rows' next tokens (`_fused`; should that pass fail, prefill and decode run apart, so
that the failure is blamed as below). Otherwise (CausalBatch) the running batch holds one key/value cache,
left padded to a common length, with an attention mask marking each row's real positions and explicit position ids.
A prefilled newcomer's cache is padded on the left to the batch's length (or the batch's to the
newcomer's) and concatenated along the batch dimension; a row that leaves is dropped from the cache,
and columns that became padding for every row are cut. **A seq2seq model whose decoder's positions are relative
(T5) joins at the next step** too (Seq2SeqBatch: encoder outputs padded on the right, decoder keys on the left); one
with absolute positions (BART) joins at the next batch: waiting requests are admitted when the running batch is empty
(rows still leave as they finish).

The engine knows nothing of HTTP or asyncio: each `Sequence` carries an `emit(text, finish_reason)`
callback that the engine calls from its thread with each new piece of text (held back while it may be
the start of a stop string, or an incomplete character), and once with the reason it finished
("stop", "length", "cancelled", or "error"). The waiting list is bounded: `submit` raises `QueueFull`.
Text is decoded incrementally (serve/detokenize.py): a few tokens' window per token, not the whole answer.

**Generation callable from training.** `GenerationEngine.from_model(model, tokenizer)` runs on a live model (the
very object: a training step's new weights are what the next call uses) and `engine.generate(prompts, params)`
returns the completions synchronously, running the loop in the caller's thread (or waiting for the engine's
thread once `start`ed). The batch type (which rows may join a running batch) is the generator's family's. Its
texts are the generated tokens decoded alone, as TRL decodes the completions its rewards read; a served text is what
the prompt continues with, as vLLM's (with a SentencePiece tokenizer the first token keeps its leading space).

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
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from tuneforge.generation_defaults import SAMPLING_EPS
from tuneforge.running_batch import CausalBatch, Seq2SeqBatch, SlotBatch  # noqa: F401  (the batch types, re-exported)
from tuneforge.serve.detokenize import IncrementalText
from tuneforge.serve.logit_rules import changes_logits, min_p_kept, penalised, top_k_kept
from tuneforge.serve.logprobs import TokenLogprob, chosen_logprobs, prompt_logprobs
from tuneforge.serve.options import MAX_BATCH_SIZE, MAX_QUEUE

log = logging.getLogger(__name__)


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
    # what they do: serve/logit_rules.py (their neutral values change nothing)
    top_k: int = 0  # 0 or -1: every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # no end-of-sequence (nor stop string) before this many tokens
    ignore_eos: bool = False  # the end-of-sequence tokens do not end it (max_tokens, a stop string or the context do)
    # log-probs recorded (serve/logprobs.py): None records none; k: each token's and the k most likely
    logprobs: int | None = None  # of each generated token (an ending end-of-sequence token too)
    prompt_logprobs: int | None = None  # of each prompt token (echo); a causal LM's only
    # logit_bias as tensors (token ids, biases), built once: a request may bias the whole vocabulary, and a loop
    # over its pairs at every step held up every row of the batch (0.3 s a step for SmolLM2's 49,152 tokens)
    bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.logit_bias:
            ids = torch.tensor([token for token, _ in self.logit_bias], dtype=torch.long)
            biases = torch.tensor([bias for _, bias in self.logit_bias], dtype=torch.float32)
            object.__setattr__(self, "bias_tensors", (ids, biases))  # frozen: set once, here


@dataclass(frozen=True)
class Completion:
    """What `GenerationEngine.generate` gives back for one prompt."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stop_token: int | None = None  # the end-of-sequence token that ended it (not in token_ids), if one did


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
    detokenizer: IncrementalText | None = None  # set by the engine when the sequence joins
    logprobs: list[TokenLogprob] = field(default_factory=list)  # params.logprobs: one per token sampled
    prompt_logprobs: list[TokenLogprob] | None = None  # params.prompt_logprobs: one per prompt token
    constraint: Any = None  # response_format's grammar (serve/constrained.py Constraint): which tokens may come next
    stop_token: int | None = None  # the end-of-sequence token sampled last, when one ended it
    # the text is what a continued prompt continues with (its last tokens decoded as context, as vLLM's), not the
    # tokens decoded alone: with a SentencePiece tokenizer the first token keeps its leading space
    text_after_prompt: bool = True

    def cancel(self) -> None:
        """Called from any thread: the engine drops the row at its next step."""
        self.cancelled = True


def sample(logits: torch.Tensor, rows: Seq[Sequence], eos_ids=frozenset(), masked: bool = False) -> list[int | None]:
    """One token per row (None for a row whose sampling failed: it fails alone): each row's logits masked by its
    grammar (response_format), after its penalties, logit_bias and min_tokens (serve/logit_rules.py); then greedy
    where the temperature is below SAMPLING_EPS, else temperature, top_k, top_p and min_p sampling with the row's
    own random generator. `masked`: the grammars' masks are applied already (`grammar_masked`). Rows sampled at
    a temperature alone (no other rule: GRPO's completions) are drawn together (`plain_draws`)."""
    logits = logits.float()
    greedy = logits.argmax(-1).tolist()
    drawn = plain_draws(logits, rows)
    out: list[int | None] = []
    for i, seq in enumerate(rows):
        if i in drawn:
            out.append(drawn[i])
            continue
        try:
            base = logits[i]
            row = base if seq.constraint is None or masked else seq.constraint.mask(base)
            row = penalised(row, seq.params, seq.prompt_ids, seq.token_ids, eos_ids)
            if seq.params.temperature < SAMPLING_EPS:  # NaN is not below it: it fails in sample_row, alone
                out.append(greedy[i] if row is base else int(row.argmax()))
                continue
            out.append(sample_row(row, seq.params, seq.generator))
        except Exception as err:
            log.warning("sampling failed for one sequence (%s: %s); the others go on", type(err).__name__, err)
            out.append(None)
    return out


def is_plain(seq: Sequence, vocabulary: int) -> bool:
    """Sampled at its temperature alone: no grammar, penalty, bias, min_tokens, top_k, top_p or min_p."""
    p = seq.params
    return (
        seq.constraint is None
        and p.temperature >= SAMPLING_EPS  # NaN is not: it fails alone, in sample_row
        and not changes_logits(p)
        and not 0 < p.top_k < vocabulary
        and p.min_p == 0
        and p.top_p >= 1.0
    )


def plain_draws(logits: torch.Tensor, rows: Seq[Sequence]) -> dict[int, int]:
    """{row: token} of the plain rows, drawn in one batch: softmax at each row's temperature, each row's own
    generator's uniform draw against its cumulative probabilities (`draw_rows`: what `sample_row` draws for the
    same row alone). A row whose probabilities are not finite is left out (`sample_row` fails it alone)."""
    plain = [i for i, seq in enumerate(rows) if is_plain(seq, logits.shape[-1])]
    if len(plain) < 2:
        return {}
    temperatures = torch.tensor([rows[i].params.temperature for i in plain], device=logits.device)
    probs = torch.softmax(logits[plain] / temperatures[:, None], dim=-1)
    finite = torch.isfinite(probs).all(-1).tolist()
    tokens = draw_rows(probs, [rows[i].generator for i in plain])
    return {i: token for i, token, ok in zip(plain, tokens, finite) if ok}


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token of the row's logits at its temperature, after top_k, top_p and min_p in that order (transformers'
    and vLLM's): top_p's mass is counted before min_p drops any token."""
    probs = torch.softmax(top_k_kept(logits / params.temperature, params), dim=-1)
    if not torch.isfinite(probs).all():
        raise ValueError(f"temperature {params.temperature!r} makes the probabilities non-finite")
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # the most likely token always stays
        sorted_probs[outside] = 0
        return int(order[draw(min_p_kept(sorted_probs, params.min_p), generator)])
    return draw(min_p_kept(probs, params.min_p), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn in proportion to `probs` (need not sum to 1); see `draw_rows`."""
    return draw_rows(probs[None], [generator])[0]


def draw_rows(probs: torch.Tensor, generators: list) -> list[int]:
    """One index per row of `probs` [rows, vocabulary], drawn in proportion to it: where the row's cumulative sum
    first passes a uniform draw of its generator times the row's total (one random number a row; torch.multinomial
    takes ~2 ms a row for a 49k vocabulary). `right=True`: a zero-probability index is never drawn."""
    cdf = probs.float().cumsum(-1)  # float64 costs 9x as much here; float32's rounding (~1e-5) moves no real choice
    u = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in generators])
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=probs.shape[-1] - 1)
    return picked[:, 0].tolist()


def grammar_masked(logits: torch.Tensor, rows: Seq[Sequence]) -> torch.Tensor | None:
    """The logits with every constrained row masked by its grammar in one pass over the batch (2-3x fewer kernel
    launches than row by row on a GPU: benchmarks/README.md); None when no row is constrained, or when a grammar
    fails (then `sample` masks row by row, and the failing row fails alone)."""
    constraints = [seq.constraint for seq in rows]
    if all(c is None for c in constraints):
        return None
    from tuneforge.serve.constrained import masks

    try:
        return masks(constraints, logits)
    except Exception:
        return None


class GenerationEngine:
    """Continuous batching over a `tuneforge.generate.Generator`'s model and tokenizer (see the module doc)."""

    def __init__(
        self,
        generator,
        max_batch_size: int = MAX_BATCH_SIZE,
        max_queue: int = MAX_QUEUE,
        context: int | None = None,
        on_step: Callable[[int], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.tokenizer = generator.tokenizer
        self.model = generator.model
        self.generator = generator
        self.context = context
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.on_step = on_step or (lambda rows: None)  # called with the rows of each forward pass
        self.on_death = on_death  # called once, from the engine thread, if it dies (else the death is logged)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.batch = generator.make_batch(pad)
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

    @classmethod
    def from_model(cls, model, tokenizer, family: str | None = None, **options) -> GenerationEngine:
        """An engine over a live model (e.g. the one being trained): the very object, no copy of its weights."""
        from tuneforge.generate import Generator

        return cls(Generator.from_model(model, tokenizer, family), **options)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Synchronous generation, e.g. inside a training step: one completion per prompt. The loop runs in the
        caller's thread (or, once `start`ed, the engine's thread runs it and this waits); the model is put in
        eval mode for the while (no dropout) and given back in the mode it was in."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        done = threading.Semaphore(0)
        release = lambda text, reason: reason is None or done.release()  # noqa: E731
        # the generated tokens' text decoded alone, as TRL decodes the completions its rewards read
        seqs = [Sequence(list(p), sp, release, text_after_prompt=False) for p, sp in zip(prompts, each)]
        training = self.model.training
        self.model.eval()
        try:
            self.submit(seqs)
            if self._thread is None:
                with torch.inference_mode():
                    while any(s.finish_reason is None for s in seqs):
                        with self._wake:
                            admitted = self._admit()
                        self._step(admitted)
            else:
                for _ in seqs:
                    done.acquire()
        finally:
            self.model.train(training)
        return [Completion(s.text, list(s.token_ids), s.finish_reason, s.stop_token) for s in seqs]

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
                    self._step(admitted)
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

    def _step(self, admitted: list[Sequence]) -> None:
        """Prefill the admitted sequences, then one decode step of the running batch (one forward pass for both
        where the batch fuses them; should that pass fail, the two separate passes find whom to blame)."""
        if admitted and self.running and self.batch.fuses_prefill and self._fused(admitted):
            self._drop_finished()
            return
        if admitted:
            self._prefill(admitted)
        self._drop_finished()
        if self.running:
            self._decode()
            self._drop_finished()

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

    def _fused(self, admitted: list[Sequence]) -> bool:
        """The running rows' next tokens and the admitted prompts in one forward pass; False if it failed (the
        batch kept nothing of it)."""
        every_position = any(s.params.prompt_logprobs is not None for s in admitted)
        last = torch.tensor([s.token_ids[-1] for s in self.running])
        try:
            decoded, prefilled = self.batch.step(last, [s.prompt_ids for s in admitted], every_position)
        except Exception as err:
            log.warning("a joined step failed (%s: %s): prefill and decode again apart", type(err).__name__, err)
            return False
        prefilled = self._prompt_logprobs(admitted, prefilled, every_position)
        self._join(admitted, self.running + admitted, torch.cat([decoded, prefilled]))
        return True

    def _join(self, admitted: list[Sequence], rows: list[Sequence], logits: torch.Tensor) -> None:
        """The prefilled sequences join the running rows; each of `rows` (those of the pass) takes its next token
        from `logits`."""
        self.on_step(len(rows))
        self.prompt_tokens += sum(len(s.prompt_ids) for s in admitted)
        self.running.extend(admitted)
        self._advance(rows, self._sample(logits, rows))

    def _prompt_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, every_position: bool) -> torch.Tensor:
        """Record the prompt log-probs of the rows that asked, from every position's logits (a row whose
        log-probs fail fails alone: its prompt is in the batch already); the last logits."""
        if not every_position:
            return logits
        for seq, row in zip(seqs, logits):
            if seq.params.prompt_logprobs is not None:
                try:
                    seq.prompt_logprobs = prompt_logprobs(row, seq.prompt_ids, seq.params.prompt_logprobs)
                except Exception as err:
                    self._fail([seq], err, "prompt log-probs")
        return logits[:, -1, :]

    def _prefill(self, seqs: list[Sequence]) -> None:
        every_position = any(s.params.prompt_logprobs is not None for s in seqs)
        try:
            logits = self.batch.prefill([s.prompt_ids for s in seqs], every_position)
        except Exception as err:
            if len(seqs) > 1:  # find the sequence to blame: the first alone, the rest back to the front
                with self._wake:
                    self.waiting.extendleft(reversed(seqs[1:]))
                self._prefill(seqs[:1])
                return
            self._fail(seqs, err, "prefill")
            return
        self._join(seqs, seqs, self._prompt_logprobs(seqs, logits, every_position))

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
        self._advance(self.running, self._sample(logits, self.running))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
        """One token per row; the log-probs of those rows that record them (failing, they fail alone)."""
        allowed = grammar_masked(logits, seqs)
        tokens = sample(logits if allowed is None else allowed, seqs, self.eos_ids, masked=allowed is not None)
        rows = [i for i, (s, t) in enumerate(zip(seqs, tokens)) if t is not None and s.params.logprobs is not None]
        if rows:
            try:
                entries = chosen_logprobs(
                    logits[rows], [tokens[i] for i in rows], [seqs[i].params.logprobs for i in rows]
                )
            except Exception as err:
                log.warning("log-probs failed for %d sequence(s) (%s: %s)", len(rows), type(err).__name__, err)
                entries = [None] * len(rows)
            for i, entry in zip(rows, entries):
                if entry is None:
                    tokens[i] = None
                elif seqs[i].params.max_tokens > 0:
                    seqs[i].logprobs.append(entry)
        return tokens

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
            if seq.params.max_tokens == 0:  # an echo of the prompt alone: prefilled, nothing generated
                self._finish(seq, "length")
                continue
            if token is None:  # its sampling failed: it alone ends
                seq.finish_reason = "error"
                seq.emit("", "error")
                continue
            if token in self.eos_ids and not seq.params.ignore_eos:
                seq.stop_token = token
                self._finish(seq, "stop")
                continue
            if not self._follows_grammar(seq, token):
                continue
            seq.token_ids.append(token)
            self._update_text(seq)
            if seq.finish_reason is not None:
                continue
            if seq.constraint is not None and seq.constraint.is_finished():  # complete JSON: nothing may follow
                self._finish(seq, "stop")
                continue
            used = self.generator.kind.positions_used(len(seq.prompt_ids), len(seq.token_ids))
            if len(seq.token_ids) >= seq.params.max_tokens or (self.context and used >= self.context):
                self._finish(seq, "length")

    def _follows_grammar(self, seq: Sequence, token: int) -> bool:
        """Advance the row's grammar past `token`; a row whose grammar fails ends alone with "error"."""
        if seq.constraint is None:
            return True
        try:
            seq.constraint.accept(token)
        except Exception as err:
            log.warning("a response_format grammar failed for one sequence (%s: %s)", type(err).__name__, err)
            seq.finish_reason = "error"
            seq.emit("", "error")
            return False
        return True

    def _update_text(self, seq: Sequence) -> None:
        if seq.detokenizer is None:
            continued = seq.text_after_prompt and self.generator.kind.continues_prompt
            context = seq.prompt_ids if continued else ()
            seq.detokenizer = IncrementalText(self.tokenizer, context)
        known = len(seq.text.rstrip("\ufffd"))  # the text before this token, that it cannot change
        seq.text = seq.detokenizer.add(seq.token_ids[-1])  # a window decoded, not the whole answer again
        stops = seq.params.stop
        if stops and len(seq.token_ids) >= seq.params.min_tokens:  # a stop string ending in this token's text
            hits = [i for i in (seq.text.find(s, max(0, known - len(s) + 1)) for s in stops) if i >= 0]
            if hits:
                seq.text = seq.text[: max(min(hits), seq.sent)]
                self._finish(seq, "stop")
                return
        ready = len(seq.text.rstrip("\ufffd"))  # a trailing part of a character waits for the rest of its bytes
        hold = 0  # an ending that may grow into a stop string waits too, before min_tokens as well
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
