"""Log-probabilities of tokens, as the engine records them for `logprobs`, `top_logprobs`, `echo` and `best_of`.

They are the model's own: `log_softmax` of the raw logits, before temperature, penalties or top-k/top-p (vLLM's
default `raw_logprobs`), so an echoed prompt's log-probs equal a forward pass of the model over the same tokens, and
a token's log-prob does not depend on how it was sampled. Each entry keeps the chosen token and the `top` most
likely ones (the chosen token is added when it is not among them, as vLLM does).

A token is named by its text; a token that is a part of a character (byte-level BPE, SentencePiece's byte
fallback) by its bytes, `bytes:\\xe2\\x80` as OpenAI names them (`TokenTexts`): several such tokens would otherwise
all read "\ufffd" and collide as keys of `top_logprobs`.
"""

from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

MAX_LOGPROBS = 20  # top alternatives per token, vLLM's default max_logprobs (OpenAI's chat allows 20 too)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple[tuple[int, float], ...]  # (token id, log-prob), most likely first; the chosen token among them


def chosen_logprobs(logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int]) -> list[TokenLogprob]:
    """One entry per row of `logits` [rows, vocab]: the log-prob of `tokens[i]` and the `tops[i]` most likely."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    k = max(tops, default=0)
    values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    out = []
    for i, token in enumerate(tokens):
        top = list(zip(ids[i][: tops[i]], values[i][: tops[i]]))
        if all(t != token for t, _ in top):
            top.append((token, chosen[i]))
        out.append(TokenLogprob(token, chosen[i], tuple(top)))
    return out


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-prob of each prompt token given those before it, from one row's logits [positions, vocab] of a
    left-padded prefill (the prompt ends at the last position); the first token's is None."""
    first = TokenLogprob(prompt[0], None, ())
    if len(prompt) < 2:
        return [first]
    start = logits.shape[0] - len(prompt)
    predicting = logits[start : logits.shape[0] - 1]  # position j predicts prompt token j + 1
    return [first, *chosen_logprobs(predicting, prompt[1:], [top] * (len(prompt) - 1))]


def mean_logprob(entries: Sequence[TokenLogprob]) -> float:
    """The average log-prob per token (best_of ranks its candidates by it, as OpenAI describes best_of)."""
    return sum(e.logprob for e in entries) / len(entries) if entries else float("-inf")


def character_starts(pieces: Sequence[bytes]) -> list[int]:
    """Where each token's text starts in the text of all of them (in characters), the tokens' UTF-8 bytes decoded
    as the tokenizer decodes them (invalid bytes as U+FFFD): a token inside a character gets that character's
    start, and one after invalid bytes comes after their U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    starts, decoded = [], 0
    for piece in pieces:
        first = decoder.decode(piece[:1])  # what the bytes before it turn into, once its first byte shows
        its_own = bool(first) and not decoder.getstate()[0]  # the first byte ended a character of its own too
        starts.append(decoded + len(first) - its_own)
        decoded += len(first) + len(decoder.decode(piece[1:]))
    return starts


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TokenTexts:
    """Each token's text and bytes, remembered per token id (see the module doc)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_of = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE's alphabet
        self.text = functools.lru_cache(maxsize=1 << 17)(self._text)

    def _text(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id])
        if "\ufffd" not in text:
            return text
        raw = self._raw_bytes(token_id)
        return text if raw is None else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _raw_bytes(self, token_id: int) -> bytes | None:
        """The bytes of a token that is no whole character, where the tokenizer spells them out; else None."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if match := BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match[1], 16)])
        if piece and all(c in self.byte_of for c in piece):
            return bytes(self.byte_of[c] for c in piece)
        return None

    def bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes (chat's `bytes` field): its own, for a part of a character."""
        text = self.text(token_id)
        if text.startswith("bytes:\\x"):
            return list(self._raw_bytes(token_id))
        return list(text.encode("utf-8"))
