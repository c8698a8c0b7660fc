"""Llama 3.x JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}`` (or
several, separated by ``;``), optionally after ``<|python_tag|>``. An output that does not
start with ``{`` is plain content."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ToolParser, partial_suffix
from services.gateway.tool_parsers.sequence import CallSequenceParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._buf = ""
        self._mode: str | None = None  # None (undecided) | "content" | "calls"
        self._calls = CallSequenceParser()

    def _feed(self, text: str) -> None:
        if self._mode is None:
            self._buf += text
            head = self._buf.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip()
            elif head and partial_suffix(head, PYTHON_TAG) == len(head):
                return  # maybe the start of the tag
            if not head:
                return
            self._mode = "calls" if head[0] == "{" else "content"
            text, self._buf = (head if self._mode == "calls" else self._buf), ""
        if self._mode == "content":
            self._emit_content(text)
            return
        for d in self._calls.feed(text).calls:
            self._add_call(d.name, d.arguments)

    def _finish(self) -> None:
        if self._mode is None:
            self._emit_content(self._buf)
            self._buf = ""
