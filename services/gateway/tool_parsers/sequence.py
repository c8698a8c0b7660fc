"""Call objects one after another: ``[{...}, {...}]`` (tool_choice required, whose grammar
makes exactly that) or ``{...}; {...}`` (Llama 3's JSON tool calls). Anything between the
objects (brackets, commas, semicolons, whitespace) is skipped. A call is reported when its
object closes; an object still open at the end (the output was cut) is no call."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ToolParser
from services.gateway.tool_parsers.json_call import CallObjectReader


class CallSequenceParser(ToolParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._reader: CallObjectReader | None = None

    def _feed(self, text: str) -> None:
        while text:
            if self._reader is None:
                start = text.find("{")
                if start < 0:
                    return
                self._reader = CallObjectReader()
                text = text[start:]
            used = self._reader.feed(text)
            text = text[used:]
            if self._reader.done:
                self._closed(self._reader)
                self._reader = None

    def _closed(self, reader: CallObjectReader) -> None:
        if reader.name is None:  # an object that names no function is not a call
            return
        # A call without an arguments member takes none: {} (never an empty string).
        self._add_call(reader.name, reader.take_arguments() if reader.saw_args else "{}")
