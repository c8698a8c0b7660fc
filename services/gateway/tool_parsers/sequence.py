"""Call objects one after another: ``[{...}, {...}]`` (tool_choice required, whose grammar
makes exactly that) or ``{...}; {...}`` (Llama 3's JSON tool calls). Anything between the
objects (brackets, commas, semicolons, whitespace) is skipped."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ToolParser
from services.gateway.tool_parsers.json_call import CallObjectReader


class CallSequenceParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._reader: CallObjectReader | None = None
        self._started = False  # the current reader's call has been announced

    def _feed(self, text: str) -> None:
        while text:
            if self._reader is None:
                start = text.find("{")
                if start < 0:
                    return
                self._reader, self._started = CallObjectReader(), False
                text = text[start:]
            used = self._reader.feed(text)
            text = text[used:]
            self._drain()
            if self._reader.done:
                self._reader = None

    def _drain(self) -> None:
        reader = self._reader
        if not self._started and reader.name is not None:
            self._begin_call(reader.name)
            self._started = True
        if self._started:
            self._emit_arguments(reader.take_arguments())
