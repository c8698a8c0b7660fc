"""What every tool-call parser shares: the calls it has found, and the deltas it emits.

A parser reads one choice's text as it streams (``feed``) and splits it into content and tool
calls; ``finish`` flushes what it held back. The non-streaming response runs the same parser
over the same text, so the streamed deltas always reassemble to the whole response.
Arguments are streamed as the model wrote them (the raw JSON text of the arguments value).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call ``index``: its first delta carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        fn: dict = {"arguments": self.arguments}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
            fn = {"name": self.name, "arguments": self.arguments}
        out["function"] = fn
        return out


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (text to hold
    back until the next piece says whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """Base: call bookkeeping. Subclasses implement ``_feed`` and may override ``_finish``."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content = ""
        self._out = ParsedDelta()

    def feed(self, text: str) -> ParsedDelta:
        self._feed(text)
        return self._take()

    def finish(self) -> ParsedDelta:
        self._finish()
        return self._take()

    # -- for subclasses ---------------------------------------------------------------------

    def _feed(self, text: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        pass

    def _emit_content(self, text: str) -> None:
        if text:
            self.content += text
            self._out.content += text

    def _begin_call(self, name: str) -> None:
        call = ToolCall(new_call_id(), name)
        self.calls.append(call)
        self._out.calls.append(ToolCallDelta(len(self.calls) - 1, call.id, name))

    def _emit_arguments(self, text: str) -> None:
        if not text:
            return
        self.calls[-1].arguments += text
        index = len(self.calls) - 1
        last = self._out.calls[-1] if self._out.calls else None
        if last is not None and last.index == index:
            last.arguments += text
        else:
            self._out.calls.append(ToolCallDelta(index, arguments=text))

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out
