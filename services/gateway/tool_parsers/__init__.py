"""Tool calls read back from the model's text, by ``tool_choice`` and ``--tool-call-parser``.

    auto       the configured family parser (hermes, llama3_json)
    required   the grammar-forced JSON array of {"name", "parameters"} (``CallSequenceParser``)
    function   the whole output is the named function's arguments (``NamedFunctionParser``)
    none       no parser: the text is the content

With ``parallel_tool_calls`` false every parser keeps only the first call (the required
grammar already allows only one).
"""

from __future__ import annotations

from collections.abc import Callable

from services.gateway.tool_parsers.base import ParsedDelta, ToolCall, ToolCallDelta, ToolParser
from services.gateway.tool_parsers.hermes import HermesParser
from services.gateway.tool_parsers.llama3_json import Llama3JsonParser
from services.gateway.tool_parsers.sequence import CallSequenceParser
from services.protocol.openai_structured import ToolSpec

PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}

__all__ = ["PARSERS", "ParsedDelta", "ToolCall", "ToolCallDelta", "ToolParser", "parser_factory"]


class NamedFunctionParser(ToolParser):
    """tool_choice names a function: the grammar makes the whole output its arguments, which
    are complete only when the output is (a cut output is no call)."""

    def __init__(self, name: str, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._name = name
        self._arguments = ""

    def _feed(self, text: str) -> None:
        self._arguments += text

    def _finish(self) -> None:
        self._add_call(self._name, self._arguments)


def parser_factory(spec: ToolSpec | None,
                   configured: str | None) -> Callable[[], ToolParser] | None:
    """A maker of one parser per choice, or None when the text is plain content. The caller
    has refused tool_choice auto without a configured parser (``needs_parser``)."""
    if spec is None or spec.choice == "none":
        return None
    max_calls = None if spec.parallel else 1
    if spec.choice == "required":
        return lambda: CallSequenceParser(max_calls)
    if spec.choice == "function":
        return lambda: NamedFunctionParser(spec.function, max_calls)
    parser = PARSERS[configured]
    return lambda: parser(max_calls)
