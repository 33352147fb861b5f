"""The generation service behind the OpenAI routes: a served `Generator` and its `GenerationEngine`. It owns
prompt encoding (the generator's, with each refusal as a 400 naming its field), the context limit, building the
`SamplingParams` of a request, and running a request's sequences to one body or a stream of server-sent events.
The routes (serve/routes_openai.py) only turn requests into prompts and call it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from tuneforge.serve import openai_api as oa
from tuneforge.serve.engine import EngineDied, GenerationEngine, QueueFull, SamplingParams, Sequence

MAX_PROMPT_ROWS = 64  # prompts x n in one generation request


class Generation:
    """One generation request's sequences and the events the engine sends back for them."""

    def __init__(self, prompts: list[list[int]], params: list[SamplingParams], n: int) -> None:
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.seqs = []  # choice k is the (k % n)-th choice of prompt k // n, as OpenAI numbers them
        for ids, p in zip(prompts, params):
            for j in range(n):
                self.seqs.append(Sequence(ids, nth_choice(p, j), self._emitter(loop, len(self.seqs))))

    def _emitter(self, loop, index: int):
        def emit(text: str, reason: str | None) -> None:
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, (index, text, reason))
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

        return emit

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
    """(index, text, finish_reason) as the engine sends them; ApiError 504 past the deadline. `request`: stop
    (cancelling the sequences) when its client goes away; a stream learns that from its failing writes."""
    pending = len(gen.seqs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            gen.cancel()
            raise oa.ApiError(504, "the request took longer than the server's --request-timeout", kind="timeout")
        try:
            index, text, reason = await asyncio.wait_for(gen.events.get(), min(left, 1.0))
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                gen.cancel()
                return
            continue
        if reason is not None:
            pending -= 1
            if reason == "error":
                gen.cancel()
                raise oa.ApiError(500, "generation failed; see the server's log", kind="server_error")
        yield index, text, reason


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class GenerationService:
    """A served generator and its engine, as the OpenAI routes use them (see the module doc)."""

    def __init__(self, generator, engine: GenerationEngine, name: str, request_timeout_s: float) -> None:
        self.generator = generator
        self.engine = engine
        self.name = name  # the served model's name
        self.context = generator.context
        self.vocab_size = generator.model.config.vocab_size  # the logits' width: logit_bias keys below it
        self.request_timeout_s = request_timeout_s

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.generator.tokenizer, "chat_template", None))

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
        context = self.context
        if not self.generator.kind.continues_prompt and context is not None and len(ids) > context:
            raise oa.ApiError(
                400, f"{field} has {len(ids)} tokens; the model reads at most {context}: shorten it", field
            )
        return ids

    def sampling(self, body: oa.SamplingRequest, prompts, max_tokens: int | None, fields: tuple[str, str], default):
        """The request's SamplingParams; `fields`: the names of its prompt and max-tokens fields (for errors)."""
        room = self._room(max(map(len, prompts)), max_tokens, fields)
        max_tokens = max_tokens or min(default, room)
        if (body.min_tokens or 0) > max_tokens:
            raise oa.ApiError(400, f"min_tokens {body.min_tokens} is above max_tokens {max_tokens}", "min_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=oa.greedy_below_eps(body.temperature),
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop_strings(),
            seed=body.seed,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
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
        if longest >= context:
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

    async def run(self, body: oa.SamplingRequest, request: Request, gen: Generation, chat: bool):
        """The request's answer: one body, or (body.stream) a stream of server-sent events."""
        self.submit(gen)
        request.state.generation = gen  # its token counts reach the access log (serve/gate.py)
        rid, created = oa.new_id("chatcmpl" if chat else "cmpl"), oa.now()
        deadline = time.monotonic() + self.request_timeout_s
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._stream(gen, rid, created, deadline, chat, include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts, reasons = [[] for _ in gen.seqs], [None] * len(gen.seqs)
        try:
            async for index, text, reason in events(gen, request, deadline):
                texts[index].append(text)
                reasons[index] = reason or reasons[index]
        finally:
            gen.cancel()
        choices = [("".join(t), r) for t, r in zip(texts, reasons)]
        use = oa.usage(gen.prompt_tokens, gen.completion_tokens)
        return (oa.chat_body if chat else oa.completion_body)(rid, self.name, created, choices, use)

    async def _stream(self, gen: Generation, rid: str, created: int, deadline: float, chat: bool, usage: bool):
        name = self.name
        make = oa.chat_chunk if chat else oa.completion_chunk
        try:
            if chat:
                for i in range(len(gen.seqs)):
                    yield sse(oa.chat_chunk(rid, name, created, i, {"role": "assistant", "content": ""}, None))
            async for index, text, reason in events(gen, None, deadline):
                if text:
                    yield sse(make(rid, name, created, index, {"content": text} if chat else text, None))
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
