"""Incremental detokenization that is correct across multi-byte characters.

Byte-level tokenizers split one character (an emoji, a CJK glyph) over several tokens; decoding
a token alone yields U+FFFD. We decode a short sliding window instead and only emit text once
it no longer ends in a replacement character. The window starts inside the prompt so the first
generated token gets the same leading-space treatment it has in context.

A caller that needs the text only once the request has finished (no stop strings to watch)
calls ``detokenize_batch`` instead: the same text, from one batched decode.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

from services.text.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context for the first output tokens
_REPLACEMENT = "\ufffd"
_TAIL_BYTES = 4  # the longest UTF-8 character
_TAIL_FIRST = 8  # candidate ends tested first, latest first; then all the others
# What ``surrogateescape`` decodes an invalid byte to (0x80-0xff: ASCII is always valid).
_ESCAPED_BYTES = "".join(chr(0xDC00 + b) for b in range(0x80, 0x100))


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


def detokenize_batch(
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    skip_special_tokens: bool = True,
) -> list[str]:
    """For each (prompt, output) pair, the text ``IncrementalDetokenizer`` builds from pushing
    ``output``: two decodes per pair, batched, instead of two per token.

    Why it is the same text, for a byte-level tokenizer: the incremental window only moves on
    after a token that leaves the decoded text not ending in U+FFFD, i.e. no UTF-8 character
    open, and decoding splits cleanly there. So after any such token it has emitted exactly
    ``decode(context + output so far)`` minus the first ``len(decode(context))`` characters,
    and a tail that still ends in U+FFFD is held back. (Even a context that ends inside a
    character agrees: both sides cut by that same length.) Other tokenizers are replayed.
    """
    contexts = [list(p[-_PROMPT_CONTEXT:]) for p in prompts]
    if not tokenizer.decodes_bytewise:
        return [_replay(tokenizer, c, o, skip_special_tokens)
                for c, o in zip(contexts, outputs, strict=True)]
    heads = _decode(tokenizer, contexts, skip_special_tokens)
    fulls = _decode(
        tokenizer, [c + list(o) for c, o in zip(contexts, outputs, strict=True)],
        skip_special_tokens,
    )
    open_tails = [i for i, full in enumerate(fulls) if full.endswith(_REPLACEMENT)]
    if open_tails:
        seqs = [contexts[i] + list(outputs[i]) for i in open_tails]
        starts = [len(contexts[i]) for i in open_tails]
        closed = _without_open_tails(tokenizer, seqs, starts, skip_special_tokens)
        for i, full in zip(open_tails, closed, strict=True):
            fulls[i] = full
    return [full[len(head) :] for head, full in zip(heads, fulls, strict=True)]


def _without_open_tails(
    tokenizer: Tokenizer, seqs: list[list[int]], starts: list[int], skip: bool
) -> list[str]:
    """For each ``ids`` of ``seqs``, ``decode(ids[:n])`` for the largest ``n > start`` after
    which it does not end in U+FFFD ("" if none): where an output ends inside a character,
    or on a U+FFFD of its own, the incremental detokenizer holds that tail back.

    Whether a decoded text ends in U+FFFD depends on its last 4 bytes only (the longest UTF-8
    character: the decoder resynchronises at the last character's lead byte). A sequence is
    searched on its tokens' bytes; one holding a token without them (an id past the
    tokenizer's, an added token whose text holds U+FFFD) by windows of tokens
    (``_ends_by_windows``). Only the winners are decoded in full, by the tokenizer.
    """
    table = tokenizer.token_bytes(skip)
    ends: list[int | None] = [None] * len(seqs)
    by_windows = []
    for i, (ids, start) in enumerate(zip(seqs, starts, strict=True)):
        parts = [table[t] if t < len(table) else None for t in ids]
        if None in parts:
            by_windows.append(i)
        else:
            ends[i] = _end_by_bytes(parts, start)
    if by_windows:
        found = _ends_by_windows(tokenizer, [seqs[i] for i in by_windows],
                                 [starts[i] for i in by_windows], skip)
        for i, end in zip(by_windows, found, strict=True):
            ends[i] = end
    winners = [i for i, end in enumerate(ends) if end is not None]
    texts = _decode(tokenizer, [seqs[i][: ends[i]] for i in winners], skip)
    closed = [""] * len(seqs)
    for i, text in zip(winners, texts, strict=True):
        closed[i] = text
    return closed


def _decode(tokenizer: Tokenizer, seqs: list[list[int]], skip: bool) -> list[str]:
    """``tokenizer.decode_batch(seqs, skip)`` of a byte-level tokenizer: once its ids' bytes
    are at hand (``built_token_bytes``: an open tail built them), a sequence whose ids all have
    bytes is joined and decoded here, in a third of the Rust call's time (tested equal); the
    others go to the tokenizer."""
    table = tokenizer.built_token_bytes(skip)
    if table is None:
        return tokenizer.decode_batch(seqs, skip)
    texts: list[str] = []
    rest: list[int] = []
    for i, ids in enumerate(seqs):
        try:
            texts.append(b"".join([table[t] for t in ids]).decode("utf-8", "replace"))
        except (IndexError, TypeError):  # an id past the table, or one without bytes
            texts.append("")
            rest.append(i)
    if rest:
        for i, text in zip(rest, tokenizer.decode_batch([seqs[i] for i in rest], skip),
                           strict=True):
            texts[i] = text
    return texts


def _end_by_bytes(parts: list[bytes], start: int) -> int | None:
    """The largest ``n > start`` whose first ``n`` tokens' bytes do not decode to a text ending
    in U+FFFD (None if none). A cut inside the trailing run of bytes that decode to nothing
    valid never qualifies (a shorter prefix of invalid bytes stays invalid), so that run is
    skipped at once: a random model repeating one byte token costs microseconds. The cuts
    before it are tested on their last 4 bytes each."""
    data = b"".join(parts)
    ends = list(accumulate(map(len, parts)))  # ends[k]: bytes in the first k + 1 tokens
    text = data.decode("utf-8", "surrogateescape")  # each invalid byte: one escape character
    valid_end = len(data) - (len(text) - len(text.rstrip(_ESCAPED_BYTES)))
    top = min(len(parts) - 1, bisect_right(ends, valid_end))
    for n in range(top, start, -1):
        cut = ends[n - 1]
        if not data[max(cut - _TAIL_BYTES, 0):cut].decode("utf-8", "replace").endswith(
                _REPLACEMENT):
            return n
    return None


def _ends_by_windows(
    tokenizer: Tokenizer, seqs: list[list[int]], starts: list[int], skip: bool
) -> list[int | None]:
    """``_end_by_bytes`` for sequences with a token of unknown bytes: each candidate ``n`` is
    tested on a short window of tokens holding at least 4 bytes, each distinct window decoded
    once, in one batch: first the last few candidates of every sequence, then the rest for
    those still open."""
    added = tokenizer.added_token_ids
    ends: list[int | None] = [None] * len(seqs)
    candidates = [range(len(ids) - 1, start, -1) for ids, start in zip(seqs, starts, strict=True)]
    for lo, hi in ((0, _TAIL_FIRST), (_TAIL_FIRST, None)):
        todo = [i for i, end in enumerate(ends) if end is None and candidates[i][lo:hi]]
        windows = {i: [(e, _window(seqs[i], e, added)) for e in candidates[i][lo:hi]] for i in todo}
        # A repeated token gives the same window again and again: decode each one once.
        unique = list(dict.fromkeys(w for pairs in windows.values() for _, w in pairs))
        texts = dict(zip(unique, tokenizer.decode_batch(unique, skip), strict=True))
        for i, pairs in windows.items():
            ends[i] = next((e for e, w in pairs if not texts[w].endswith(_REPLACEMENT)), None)
    return ends


def _window(ids: list[int], end: int, added: frozenset[int]) -> tuple[int, ...]:
    """The tokens before ``end`` that hold its last 4 bytes: 4 BPE tokens (each at least a
    byte), and any added tokens in between (they may decode to nothing, so they do not count)."""
    start = max(end - _TAIL_BYTES, 0)
    if added.isdisjoint(ids[start:end]):
        return tuple(ids[start:end])  # the common case
    start, count = end, 0
    while start > 0 and count < _TAIL_BYTES:
        start -= 1
        count += ids[start] not in added
    return tuple(ids[start:end])


def _replay(
    tokenizer: Tokenizer, context: Sequence[int], output: Sequence[int], skip: bool
) -> str:
    detok = IncrementalDetokenizer(tokenizer, context, skip)
    detok.push(output)
    return detok.text
