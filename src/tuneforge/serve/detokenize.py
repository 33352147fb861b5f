"""Incremental detokenization: the text of a growing list of token ids at a flat cost per token.

Decoding the whole sequence again on every token is quadratic in the answer's length. As vLLM's detokenizer and
transformers' TextStreamer do, `IncrementalText` decodes only a short window: the tokens from `prefix_offset`
(a few already-read tokens, so that a tokenizer that strips the first token's leading space, or that merges
across tokens, decodes the new ones in context) to the end, and takes what lies past the window's already-read
text. New text that ends in the replacement character (a character whose bytes have not all arrived) stays
unconfirmed: it is still part of `text`, but the next token decodes it again.

A continued prompt's last tokens are the first window's context, as vLLM seeds its detokenizer with them: a
SentencePiece (Metaspace) tokenizer drops the leading space of a text's first token, so without them " Paris"
after "The capital of France is" would read "Paris". The text is then what the prompt continues with:
`decode(prompt + ids)[len(decode(prompt)):]`.
"""

from __future__ import annotations

from collections.abc import Sequence

INITIAL_PREFIX_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
REPLACEMENT = "\ufffd"


class IncrementalText:
    """The decoded text of `ids` (with special tokens skipped) after `context` (a continued prompt's token ids, of
    which the last INITIAL_PREFIX_TOKENS are read), kept up to date token by token."""

    def __init__(self, tokenizer, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context[len(context) - INITIAL_PREFIX_TOKENS :] if context else [])
        self.start = len(self.ids)  # the context's tokens, before the text's own
        self.context_text = self._decode(self.ids)
        self.confirmed = ""  # the text of ids[start:read_offset]
        self.prefix_offset = 0  # where the decoding window starts
        self.read_offset = self.start  # tokens whose text is confirmed
        self.text = ""  # confirmed + the text of the tokens after read_offset (may end in REPLACEMENT)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append one token; the whole text so far."""
        self.ids.append(token)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset :])
        if not window_text.startswith(prefix_text):  # the window decodes differently in context: decode it all
            self.text = self._decode(self.ids)[len(self.context_text) :]
            self._confirm_all()
            return self.text
        tail = window_text[len(prefix_text) :]
        self.text = self.confirmed + tail
        if tail and not tail.endswith(REPLACEMENT):
            self.confirmed = self.text
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self.text

    def _confirm_all(self) -> None:
        if not self.text.endswith(REPLACEMENT):
            self.confirmed = self.text
            self.prefix_offset = max(0, len(self.ids) - INITIAL_PREFIX_TOKENS)
            self.read_offset = len(self.ids)
