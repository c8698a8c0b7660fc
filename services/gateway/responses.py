"""OpenAI response bodies and stream chunks for completions and chat, built from ChoiceDeltas.

``ResponseBuilder`` keeps what each choice has produced; the handlers feed it deltas and ask
for stream chunks as they go, or for the whole response object at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.choice import ChoiceDelta
from services.gateway.tool_parsers import ParsedDelta, ToolParser, parser_factory
from services.protocol import openai as oa
from services.protocol.openai_structured import ToolSpec


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """How a chat request's text is read into tool calls: one parser per choice."""

    make_parser: Callable[[], ToolParser]
    # tool_choice auto or required ends with finish_reason "tool_calls" when it made calls;
    # a named function ends with "stop", as OpenAI's.
    finish_as_tool_calls: bool

    @classmethod
    def of(cls, spec: ToolSpec | None, configured: str | None) -> ToolOutput | None:
        make = parser_factory(spec, configured)
        if make is None:
            return None
        return cls(make, spec.choice != "function")


@dataclass(slots=True)
class _Choice:
    index: int
    prompt_index: int
    echo: str = ""
    text: str = ""
    logprobs: list[oa.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # completions: characters already sent, for logprobs' text_offset
    echo_logprobs: list[oa.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    echo_sent: bool = False  # streaming: the echoed prompt has gone out
    tools: ToolParser | None = None  # chat with tools: splits the text into content and calls


class ResponseBuilder:
    def __init__(
        self,
        kind: str,
        rid: str,
        model: str,
        choice_prompts: dict[int, int],
        want_logprobs: bool,
        echo_texts: list[str] | None = None,
        prompt_logprobs: bool = False,
        tools: ToolOutput | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self._build = oa.chat_object if kind == "chat" else oa.completion_object
        self._fingerprint = fingerprint  # system_fingerprint, on the body and every chunk
        self._want_logprobs = want_logprobs
        self._want_prompt_logprobs = prompt_logprobs
        # Completions echo with logprobs: the prompt's logprobs lead the choice's logprobs, so
        # a streamed echo waits for them (they come with the first tokens).
        self._echo_waits = echo_texts is not None and want_logprobs
        self._tools = tools
        self._choices = {
            i: _Choice(i, p, echo=echo_texts[p] if echo_texts else "",
                       tools=tools.make_parser() if tools is not None else None)
            for i, p in sorted(choice_prompts.items())
        }

    def add(self, delta: ChoiceDelta) -> ParsedDelta | None:
        """Records ``delta``; with tools, returns what its text added to content and calls."""
        c = self._choices[delta.index]
        c.text += delta.text
        c.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            c.prompt_logprobs = delta.prompt_logprobs
            c.echo_logprobs = delta.echo_logprobs or []
        parsed = None
        if c.tools is not None:
            parsed = c.tools.feed(delta.text)
        if delta.finish_reason is not None:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
            if c.tools is not None:
                rest = c.tools.finish()
                parsed.content += rest.content
                parsed.calls.extend(rest.calls)
                if c.tools.calls and self._tools.finish_as_tool_calls and (
                        c.finish_reason == "stop"):
                    c.finish_reason = "tool_calls"
        return parsed

    def _message(self, c: _Choice) -> dict[str, Any]:
        if c.tools is None:
            return {"role": "assistant", "content": c.text}
        calls = [call.to_openai() for call in c.tools.calls]
        content = c.tools.content if c.tools.content or not calls else None
        return {"role": "assistant", "content": content, "tool_calls": calls}

    # -- whole responses --------------------------------------------------------------------

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "chat":
            choices = [
                {
                    "index": c.index,
                    "message": self._message(c),
                    "logprobs": oa.chat_logprobs(c.logprobs) if self._want_logprobs else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in self._choices.values()
            ]
            body = self._build(self.rid, self.model, choices, usage,
                               fingerprint=self._fingerprint)
            if self._want_prompt_logprobs:  # vLLM: one list for the (one) prompt, top level
                body["prompt_logprobs"] = next(iter(self._choices.values())).prompt_logprobs
            return body
        choices = []
        for c in self._choices.values():
            choice: dict[str, Any] = {
                "index": c.index,
                "text": c.echo + c.text,
                "logprobs": (
                    # With echo, the prompt's own logprobs lead (and give the offsets).
                    oa.completion_logprobs(c.echo_logprobs + c.logprobs)
                    if self._want_logprobs else None
                ),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if self._want_prompt_logprobs:
                choice["prompt_logprobs"] = c.prompt_logprobs
            choices.append(choice)
        return self._build(self.rid, self.model, choices, usage, fingerprint=self._fingerprint)

    # -- stream chunks ----------------------------------------------------------------------

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chat: the assistant role of every choice. Completions: the echoed prompts."""
        if self.kind == "chat":
            return [
                self._chunk(
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
                for c in self._choices.values()
            ]
        out = []
        for c in self._choices.values():
            if c.echo and not self._echo_waits:
                c.echo_sent = True
                out.append(
                    self._chunk(
                        {
                            "index": c.index,
                            "text": c.echo,
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                )
                c.text_offset = len(c.echo)
        return out

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any]:
        """The stream chunk for ``delta`` (also recorded, as by ``add``)."""
        parsed = self.add(delta)
        c = self._choices[delta.index]
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": delta.index,
                "delta": _chat_delta(delta.text, parsed),
                "logprobs": oa.chat_logprobs(delta.logprobs) if self._want_logprobs else None,
                "finish_reason": c.finish_reason if delta.finish_reason else None,
            }
            if delta.prompt_logprobs is not None and self._want_prompt_logprobs:
                choice["prompt_logprobs"] = delta.prompt_logprobs
        else:
            text, items = delta.text, delta.logprobs
            if c.echo and not c.echo_sent:  # the echo, with its logprobs, leads this chunk
                c.echo_sent = True
                text, items = c.echo + text, (delta.echo_logprobs or []) + items
            choice = {
                "index": delta.index,
                "text": text,
                "logprobs": (
                    oa.completion_logprobs(items, c.text_offset) if self._want_logprobs else None
                ),
                "finish_reason": delta.finish_reason,
            }
            if delta.prompt_logprobs is not None and self._want_prompt_logprobs:
                choice["prompt_logprobs"] = delta.prompt_logprobs
            c.text_offset += len(text)
        if delta.finish_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        return self._chunk(choice)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._build(self.rid, self.model, [], usage, chunk=True,
                           fingerprint=self._fingerprint)

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return self._build(self.rid, self.model, [choice], None, chunk=True,
                           fingerprint=self._fingerprint)


def _chat_delta(text: str, parsed: ParsedDelta | None) -> dict[str, Any]:
    if parsed is None:
        return {"content": text} if text else {}
    out: dict[str, Any] = {}
    if parsed.content:
        out["content"] = parsed.content
    if parsed.calls:
        out["tool_calls"] = [d.to_openai() for d in parsed.calls]
    return out
