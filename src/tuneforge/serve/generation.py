"""The generation service behind the OpenAI routes: a served `Generator` and its `GenerationEngine`. It owns prompt
encoding (the generator's, with each refusal as a 400 naming its field), the context limit, building the
`SamplingParams` of a request (a field it leaves out: the model's own default under --generation-config auto,
tuneforge/generation_defaults.py; a seq2seq model's max_tokens: the generation_max_length of its tuneforge.json, its
num_beams named as not applied: `served_trained_settings`), and running a request's sequences to one body or a
stream of server-sent events. The routes (serve/routes_openai.py) only turn requests into prompts and call it. What
the chat template tells of tools (whether it renders them, which parser its replies need: tuneforge/tool_calls.py)
is fixed for the served model: probed once, on the first request that needs it, and read by every request after
(`renders_tools`, `tool_family`).

Log-probs (serve/logprobs.py) reach the answer as the engine records them: each event carries the entries of the
tokens its text came from. `best_of` runs that many candidates of each prompt and answers with the `n` of highest
average log-prob per token (OpenAI's definition), best first; it does not stream (the best are known at the end)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from tuneforge import tool_calls
from tuneforge.files import json_text
from tuneforge.generate import is_count
from tuneforge.serve import openai_api as oa
from tuneforge.serve.engine import EngineDied, GenerationEngine, QueueFull, SamplingParams, Sequence
from tuneforge.serve.logprobs import TokenTexts, mean_logprob

MAX_PROMPT_ROWS = 64  # prompts x n in one generation request
# the positions of a seq2seq model whose config names none (T5's relative positions), as vLLM assumes for one
UNSTATED_CONTEXT = 2048
DISCONNECT_CHECK_S = 0.25  # how often a non-streamed request looks for its client gone


@dataclass(frozen=True)
class Shape:
    """What a request's answer shows beyond text: `logprobs` alternatives per token (None: no log-probs; chat's
    top_logprobs), `echo` (per prompt, its text before each of its choices' own), `tool_family` (chat with tools:
    each reply read for tool calls with that template family's parser, tuneforge/tool_calls.py), `forced` (a
    tool_choice that forces a call: the reply is the call's JSON, constrained by the tools' schema), `parallel`
    (False: parallel_tool_calls false, a reply's first call only)."""

    chat: bool
    logprobs: int | None = None
    echo: list[str] | None = None
    tool_family: str | None = None
    forced: str | dict | None = None
    parallel: bool = True


class Generation:
    """One generation request's sequences and the events the engine sends back for them: (index, text,
    finish_reason, log-prob entries of the tokens the text came from)."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        n: int,
        best_of: int | None = None,
        eos_logprob: bool = True,
        constraint=None,
    ) -> None:
        """`constraint`: the request's response_format grammar (serve/constrained.py), a copy for each sequence."""
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.n, self.candidates = n, max(n, best_of or n)
        self.eos_logprob = eos_logprob  # an ending eos token's log-prob shown (completions) or not (chat)
        self.seqs = []  # sequence k is candidate k % candidates of prompt k // candidates
        for ids, p in zip(prompts, params):
            for j in range(self.candidates):
                seq = Sequence(ids, nth_choice(p, j), self._emitter(loop, len(self.seqs)))
                seq.constraint = None if constraint is None else constraint.copy()
                self.seqs.append(seq)
        self._shown = [0] * len(self.seqs)  # log-prob entries of each sequence already sent

    def _emitter(self, loop, index: int):
        def emit(text: str, reason: str | None) -> None:  # in the engine's thread, which alone writes the entries
            seq = self.seqs[index]
            end = len(seq.logprobs) if self.eos_logprob else min(len(seq.logprobs), len(seq.token_ids))
            entries, self._shown[index] = seq.logprobs[self._shown[index] : end], end
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, (index, text, reason, entries))
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

        return emit

    def answers(self) -> list[int]:
        """The sequences answering, in choice order: all of them, or the n best candidates of each prompt."""
        if self.candidates == self.n:
            return list(range(len(self.seqs)))
        chosen = []
        for start in range(0, len(self.seqs), self.candidates):
            group = range(start, start + self.candidates)
            ranked = sorted(group, key=lambda k: mean_logprob(self.seqs[k].logprobs), reverse=True)
            chosen.extend(ranked[: self.n])
        return chosen

    def cancel(self) -> None:
        for seq in self.seqs:
            if seq.finish_reason is None:
                seq.cancel()

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


def nth_choice(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th choice of a request: its own seed (seed + j), so n choices differ and each is reproducible."""
    if params.seed is None or j == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + j)


async def events(gen: Generation, request: Request | None, deadline: float):
    """(index, text, finish_reason, log-prob entries) as the engine sends them; ApiError 504 past the deadline.
    `request`: stop (cancelling the sequences) when its client goes away, looked at every DISCONNECT_CHECK_S
    whether tokens keep coming or not; a stream learns that from its failing writes."""
    pending = len(gen.seqs)
    checked = time.monotonic()
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            gen.cancel()
            raise oa.ApiError(504, "the request took longer than the server's --request-timeout", kind="timeout")
        if request is not None and time.monotonic() - checked >= DISCONNECT_CHECK_S:
            checked = time.monotonic()
            if await request.is_disconnected():
                gen.cancel()
                return
        try:
            index, text, reason, entries = await asyncio.wait_for(gen.events.get(), min(left, DISCONNECT_CHECK_S))
        except asyncio.TimeoutError:
            continue
        if reason is not None:
            pending -= 1
            if reason == "error":
                gen.cancel()
                raise oa.ApiError(500, "generation failed; see the server's log", kind="server_error")
        yield index, text, reason, entries


def served_context(generator) -> int | None:
    """The positions a served request may use (None: no limit): the model's context; a seq2seq model whose config
    names none (T5) reads and writes at most UNSTATED_CONTEXT tokens, or more where its inputs' max_length or its
    trained generation_max_length is more. Unbounded, one input of a million tokens (a 4 MiB body) took the engine for
    hours, its encoder's attention memory growing with the square of the length, and a huge max_tokens held every
    other request back."""
    context = generator.context
    if context is not None or generator.kind.continues_prompt:
        return context
    inputs = generator.kind.max_prompt_tokens(generator.info) or 0
    outputs = generator.trained_sampling({}).get("max_new_tokens", 0) + 1  # the decoder's start token: a position
    return max(UNSTATED_CONTEXT, inputs, outputs)


def served_trained_settings(generator, max_length: int | None) -> tuple[dict, dict]:
    """(the settings of its training, tuneforge.json's, that a model is served with; those it is not): a seq2seq
    model's source_prefix and max_length (unless --max-length, `max_length`, replaces it) and generation_max_length
    (the default max_tokens) taken, its num_beams not: the server has no beam search (nor has vLLM)."""
    taken = dict(generator.kind.trained_settings(generator.info))
    if max_length is not None:
        taken.pop("max_length", None)
    if not is_count(taken.get("generation_max_length")):  # a hand-edited value `trained_sampling` leaves out too
        taken.pop("generation_max_length", None)
    beams = taken.pop("num_beams", None)
    return taken, ({"num_beams": beams} if is_count(beams) and beams > 1 else {})


def trained_settings_line(taken: dict, not_applied: dict) -> str | None:
    """The server's start-up line naming `served_trained_settings`' two parts (None: none of either)."""
    if not taken and not not_applied:
        return None
    said = [f"{name} {value!r}" if isinstance(value, str) else f"{name} {value}" for name, value in taken.items()]
    if "generation_max_length" in taken:  # named last (generate.SEQ2SEQ_DECODING's order, num_beams taken out)
        said[-1] += " (the default max_tokens)"
    line = f"settings the model was trained with (its tuneforge.json): {', '.join(said) or 'none taken'}"
    if not_applied:
        line += (
            f"; its num_beams {not_applied['num_beams']} is not applied: the server has no beam search (as vLLM), "
            "it decodes greedily at temperature 0 and samples otherwise, so its answers may differ from those "
            "`eval` scored and `tuneforge generate` prints"
        )
    return line


def sse(body: dict) -> str:
    return f"data: {json_text(body, ensure_ascii=False)}\n\n"


class GenerationService:
    """A served generator and its engine, as the OpenAI routes use them (see the module doc)."""

    def __init__(
        self,
        generator,
        engine: GenerationEngine,
        name: str,
        request_timeout_s: float,
        defaults: dict | None = None,
        max_length: int | None = None,
    ) -> None:
        """`defaults`: the model's own sampling defaults in the API's names (generation_defaults.ModelDefaults'
        `served`, under --generation-config auto), what a request that leaves a field out samples with;
        `max_length`: serve's --max-length (in place of a seq2seq model's trained one)."""
        self.generator = generator
        self.trained_settings, self.trained_not_applied = served_trained_settings(generator, max_length)
        # a seq2seq model's generation_max_length (its tuneforge.json): the length `eval` scored its outputs at and
        # `tuneforge generate` decodes to, whole (not cut at OpenAI's 16), whatever its generation config says
        self.trained_max_tokens = generator.trained_sampling({}).get("max_new_tokens")
        self.defaults = {**(defaults or {}), **self.trained_defaults()}
        self.engine = engine
        self.name = name  # the served model's name
        self.context = served_context(generator)
        self.vocab_size = generator.model.config.vocab_size  # the logits' width: logit_bias keys below it
        self.token_texts = TokenTexts(generator.tokenizer)  # how log-probs name tokens
        self.eos_ids = engine.eos_ids if engine is not None else set()
        self.request_timeout_s = request_timeout_s

    async def constraint(self, response_format):
        """response_format's grammar (serve/constrained.py; None for text), compiled off the event loop (a large
        schema takes up to a second); ApiError 400 naming the field for one that cannot be honoured."""
        if response_format is None:  # plain text: llguidance is not even imported
            return None
        from tuneforge.serve import constrained

        def compile_it():
            vocab = constrained.tokenizer_for(self.generator.tokenizer, self.eos_ids or None)  # built once a model
            return constrained.compile_response_format(response_format, vocab)

        try:
            return await asyncio.to_thread(compile_it)
        except constrained.ResponseFormatError as err:
            raise oa.ApiError(400, str(err), err.param) from None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.generator.tokenizer, "chat_template", None))

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a `tools=` list (tool_calls.supports_tools' probe, rendered once)."""
        return tool_calls.supports_tools(self.generator.tokenizer)

    @functools.cached_property
    def tool_family(self) -> str:
        """The parser the template's replies need (tool_calls.template_family, read from the template once)."""
        return tool_calls.template_family(self.generator.tokenizer)

    def encode(self, text: str, field: str, special: bool = True) -> list[int]:
        """The prompt's token ids; ApiError 400 naming `field` for text without tokens, text the tokenizer fails
        on, or (a model whose encoder reads the prompt) more tokens than it has positions. A continued prompt's
        length is checked with max_tokens."""
        try:
            ids = self.generator.encode_prompt(text, add_special_tokens=special)
        except Exception as err:  # the tokenizer's own refusal, whatever the text held
            raise oa.ApiError(400, f"{field} could not be tokenized: {type(err).__name__}", field) from None
        if not ids:
            raise oa.ApiError(400, f"{field} has no tokens; give the model some text", field)
        return self.check_ids(ids, field)

    def check_ids(self, ids: list[int], field: str) -> list[int]:
        """ApiError 400 for a prompt longer than a model whose encoder reads it has positions (a continued prompt's
        length is checked with max_tokens)."""
        context = self.context
        if not self.generator.kind.continues_prompt and context is not None and len(ids) > context:
            raise oa.ApiError(
                400, f"{field} has {len(ids)} tokens; the model reads at most {context}: shorten it", field
            )
        return ids

    def trained_defaults(self) -> dict:
        return {} if self.trained_max_tokens is None else {"max_tokens": self.trained_max_tokens}

    def default_max_tokens(self, server_default: int, cap: bool = False) -> int:
        """The max_tokens of a request that gives none: a seq2seq model's trained generation_max_length, else the
        model's max_new_tokens in place of `server_default` (chat), or (`cap`, completions: OpenAI's 16) the
        smaller of the two, as vLLM takes them."""
        own = self.defaults.get("max_tokens")
        if own is None:
            return server_default
        if self.trained_max_tokens is not None:
            return own
        return min(own, server_default) if cap else own

    def given(self, body: oa.SamplingRequest, name: str, neutral):
        """The request's value of a sampling field; left out, the model's default, else `neutral` (OpenAI's)."""
        value = getattr(body, name)
        if value is None:
            value = self.defaults.get(name)
        return neutral if value is None else value

    def sampling(self, body: oa.SamplingRequest, prompts, max_tokens: int | None, fields: tuple[str, str], default):
        """The request's SamplingParams, log-probs aside (`dataclasses.replace` adds them); `fields`: the names of
        its prompt and max-tokens fields (for errors); a field it leaves out: the model's default (`given`)."""
        room = self._room(max(map(len, prompts)), max_tokens, fields)
        max_tokens = min(default, room) if max_tokens is None else max_tokens
        if (body.min_tokens or 0) > max_tokens:
            raise oa.ApiError(400, f"min_tokens {body.min_tokens} is above max_tokens {max_tokens}", "min_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=oa.greedy_below_eps(self.given(body, "temperature", None)),
            top_p=self.given(body, "top_p", 1.0),
            stop=body.stop_strings(),
            seed=body.seed,
            top_k=self.given(body, "top_k", 0),
            min_p=self.given(body, "min_p", 0.0),
            repetition_penalty=self.given(body, "repetition_penalty", 1.0),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=body.bias(self.vocab_size),
            min_tokens=body.min_tokens or 0,
            ignore_eos=bool(body.ignore_eos),
        )

    def _room(self, longest: int, max_tokens: int | None, fields: tuple[str, str]) -> int | float:
        """The new tokens the context leaves (inf: no limit); ApiError 400 for a request past it."""
        prompt_field, field = fields
        context = self.context
        if context is None:
            return float("inf")
        if not self.generator.kind.continues_prompt:  # a decoder with its own positions
            if max_tokens is not None and max_tokens >= context:
                raise oa.ApiError(
                    400, f"{field} {max_tokens} is above the model's limit of {context - 1} tokens", field
                )
            return float("inf")
        if longest > context or (longest == context and max_tokens != 0):  # max_tokens 0: an echo scores it alone
            raise oa.ApiError(
                400, f"the prompt has {longest} tokens; the model's context is {context}: shorten it", prompt_field
            )
        room = context - longest
        if max_tokens is not None and max_tokens > room:
            raise oa.ApiError(
                400,
                f"{field} {max_tokens} plus the prompt's {longest} tokens is above the model's context of "
                f"{context} tokens; ask for at most {room}",
                field,
            )
        return room

    def submit(self, gen: Generation) -> None:
        try:
            self.engine.submit(gen.seqs)
        except QueueFull as err:
            raise oa.ApiError(503, f"the server is busy ({err}); retry later", kind="server_busy") from None
        except EngineDied:  # it died since the readiness check: as that check would now say
            raise oa.ApiError(503, "the model failed; see the server's log", kind="server_error") from None

    async def run(self, body: oa.SamplingRequest, request: Request, gen: Generation, shape: Shape):
        """The request's answer: one body, or (body.stream) a stream of server-sent events."""
        self.submit(gen)
        request.state.generation = gen  # its token counts reach the access log (serve/gate.py)
        rid, created = oa.new_id("chatcmpl" if shape.chat else "cmpl"), oa.now()
        deadline = time.monotonic() + self.request_timeout_s
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self.stream(gen, shape, rid, created, deadline, include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts, reasons = [[] for _ in gen.seqs], [None] * len(gen.seqs)
        try:
            async for index, text, reason, _ in events(gen, request, deadline):
                texts[index].append(text)
                reasons[index] = reason or reasons[index]
        finally:
            gen.cancel()
        answers = gen.answers()
        echo = [shape.echo[k // gen.candidates] if shape.echo else "" for k in answers]
        choices = [(e + "".join(texts[k]), reasons[k]) for e, k in zip(echo, answers)]
        use = oa.usage(gen.prompt_tokens, gen.completion_tokens)
        body = (oa.chat_body if shape.chat else oa.completion_body)(rid, self.name, created, choices, use)
        if shape.logprobs is not None:
            for choice, k in zip(body["choices"], answers):
                choice["logprobs"] = self._logprobs(gen.seqs[k], shape)
        return oa.with_tool_calls(body, shape.tool_family, shape.forced, shape.parallel) if shape.tool_family else body

    def _logprobs(self, seq: Sequence, shape: Shape) -> dict:
        """A whole choice's log-probs: an echoed prompt's first, then the generated tokens'."""
        if shape.chat:
            return oa.chat_logprobs(seq.logprobs[: len(seq.token_ids)], self.token_texts, shape.logprobs)
        entries = (seq.prompt_logprobs or []) + seq.logprobs
        return oa.completion_logprobs(entries, self.token_texts)

    async def stream(self, gen: Generation, shape: Shape, rid: str, created: int, deadline: float, usage: bool):
        """The answer as server-sent events, from the events of `gen` as the engine sends them."""
        name, chat = self.name, shape.chat
        make = oa.chat_chunk if chat else oa.completion_chunk
        offsets = [None] * len(gen.seqs)  # each choice's text length so far (None: nothing sent yet)
        try:
            if chat:
                for i in range(len(gen.seqs)):
                    yield sse(oa.chat_chunk(rid, name, created, i, {"role": "assistant", "content": ""}, None))
            held: dict[int, tuple[list, list]] = {}  # tool calls: each choice's text and entries, until it ends
            async for index, text, reason, entries in events(gen, None, deadline):
                if shape.tool_family:
                    texts, kept = held.setdefault(index, ([], []))
                    texts.append(text)
                    kept.extend(entries)
                    if reason is not None:
                        for chunk in self._tool_call_chunks(shape, rid, created, index, held.pop(index), reason):
                            yield sse(chunk)
                    continue
                if offsets[index] is None:  # its first event: the engine has run its prompt
                    offsets[index] = 0
                    if shape.echo:
                        yield sse(self._echo_chunk(gen, index, shape, rid, created))
                        offsets[index] = len(shape.echo[index // gen.candidates])
                if text or entries:
                    chunk = make(rid, name, created, index, {"content": text} if chat else text, None)
                    if shape.logprobs is not None:
                        chunk["choices"][0]["logprobs"] = self._chunk_logprobs(entries, shape, offsets[index])
                    offsets[index] += len(text)
                    yield sse(chunk)
                if reason is not None:
                    yield sse(make(rid, name, created, index, {} if chat else "", reason))
            if usage:
                use = oa.usage(gen.prompt_tokens, gen.completion_tokens)
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield sse(oa.usage_chunk(rid, name, created, obj, use))
        except oa.ApiError as err:
            yield sse(err.body())
        finally:
            gen.cancel()
        yield "data: [DONE]\n\n"

    def _tool_call_chunks(self, shape: Shape, rid: str, created: int, index: int, held, reason: str) -> list[dict]:
        """A finished chat choice's held-back text read for tool calls: one delta with its content and whole calls
        (its log-probs too), then its finish (tool_calls.finish_reason). vLLM streams the calls piece by piece as
        its parser recognises them; a whole call per delta is what OpenAI's clients accumulate all the same."""
        texts, entries = held
        content, calls = tool_calls.read_reply("".join(texts), shape.tool_family, shape.forced, shape.parallel)
        chunks = []
        if content or calls:
            chunk = oa.chat_chunk(rid, self.name, created, index, oa.tool_call_delta(content, calls), None)
            if shape.logprobs is not None:
                chunk["choices"][0]["logprobs"] = self._chunk_logprobs(entries, shape, 0)
            chunks.append(chunk)
        finish = tool_calls.finish_reason(reason, calls, shape.forced)
        chunks.append(oa.chat_chunk(rid, self.name, created, index, {}, finish))
        return chunks

    def _echo_chunk(self, gen: Generation, index: int, shape: Shape, rid: str, created: int) -> dict:
        """A completion's echoed prompt, with its log-probs (set by the engine's prefill, before any event)."""
        chunk = oa.completion_chunk(rid, self.name, created, index, shape.echo[index // gen.candidates], None)
        if shape.logprobs is not None:
            entries = gen.seqs[index].prompt_logprobs or []
            chunk["choices"][0]["logprobs"] = oa.completion_logprobs(entries, self.token_texts)
        return chunk

    def _chunk_logprobs(self, entries, shape: Shape, offset: int) -> dict:
        if shape.chat:
            return oa.chat_logprobs(entries, self.token_texts, shape.logprobs)
        return oa.completion_logprobs(entries, self.token_texts, offset)
