"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, any number of them. Text before the first call is the content; text after
a call (between or after the blocks) is dropped, as vLLM's parser does. A last call left
without its end tag still counts when its object is complete."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ParsedDelta, ToolParser, partial_suffix
from services.gateway.tool_parsers.sequence import CallSequenceParser

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._buf = ""
        self._inside: CallSequenceParser | None = None
        self._seen_call = False

    def _feed(self, text: str) -> None:
        self._buf += text
        while self._buf:
            if self._inside is None and not self._outside():
                return
            if self._inside is not None and not self._in_call():
                return

    def _outside(self) -> bool:
        """Content until a start tag; False when the rest must wait for more text."""
        at = self._buf.find(START)
        if at < 0:
            keep = partial_suffix(self._buf, START)
            self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(self._buf[:at])
        self._buf = self._buf[at + len(START):]
        self._inside, self._seen_call = CallSequenceParser(), True
        return True

    def _in_call(self) -> bool:
        at = self._buf.find(END)
        usable = at if at >= 0 else len(self._buf) - partial_suffix(self._buf, END)
        self._relay(self._inside.feed(self._buf[:usable]))
        if at < 0:
            self._buf = self._buf[usable:]
            return False
        self._buf = self._buf[at + len(END):]
        self._inside = None
        return True

    def _finish(self) -> None:
        if self._inside is not None:  # no end tag: a call if its object closed
            self._relay(self._inside.feed(self._buf))
        else:
            self._content(self._buf)
        self._buf = ""

    def _content(self, text: str) -> None:
        if not self._seen_call:
            self._emit_content(text)

    def _relay(self, delta: ParsedDelta) -> None:
        for d in delta.calls:
            self._add_call(d.name, d.arguments)
