"""Incremental detokenization that is correct across multi-byte characters.

Byte-level tokenizers split one character (an emoji, a CJK glyph) over several tokens; decoding
a token alone yields U+FFFD. We decode a short sliding window instead and only emit text once
it no longer ends in a replacement character. The window starts inside the prompt so the first
generated token gets the same leading-space treatment it has in context.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.text.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context for the first output tokens
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # tokens before this are already emitted
        self.text = ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds generated tokens; returns the newly decodable text (possibly empty)."""
        delta = []
        for t in token_ids:
            self._ids.append(int(t))
            delta.append(self._step())
        out = "".join(delta)
        self.text += out
        return out

    def _step(self) -> str:
        ids = self._ids
        prefix = self._tok.decode(ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # mid-character, or a token that decodes to nothing (skipped special)
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full[len(prefix) :]
