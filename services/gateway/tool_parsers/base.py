"""What every tool-call parser shares: the calls it has found, and the deltas it emits.

A parser reads one choice's text as it streams (``feed``) and splits it into content and tool
calls; ``finish`` flushes what it held back. The non-streaming response runs the same parser
over the same text, so the streamed deltas always reassemble to the whole response.

A call is sent whole, in one delta (id, name and arguments), once its arguments are complete:
the raw text of the arguments value as the model wrote it, which must parse as JSON. A call
that never completes (cut off by ``max_tokens``, a stop string or an abort) is dropped, in a
stream as in a whole response, so no client ever receives arguments it cannot parse; the
choice's finish reason (``length``...) says the output was cut. With ``max_calls`` (1 when
``parallel_tool_calls`` is false) the calls after the first ``max_calls`` are dropped, as
vLLM does.
"""

from __future__ import annotations

import json
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
    """Call ``index`` of the choice, whole: the only delta it gets."""

    index: int
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


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


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolParser:
    """Base: call bookkeeping. Subclasses implement ``_feed`` and may override ``_finish``;
    they report each call with ``_add_call`` when its text is complete."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.calls: list[ToolCall] = []
        self.content = ""
        self._max_calls = max_calls
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

    def _add_call(self, name: str, arguments: str) -> None:
        """A call whose text is complete: kept (and sent) unless its arguments are not JSON or
        the choice already has ``max_calls`` calls."""
        if self._max_calls is not None and len(self.calls) >= self._max_calls:
            return
        if not is_json(arguments):
            return
        call = ToolCall(new_call_id(), name, arguments)
        self.calls.append(call)
        self._out.calls.append(ToolCallDelta(len(self.calls) - 1, call.id, name, arguments))

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out
