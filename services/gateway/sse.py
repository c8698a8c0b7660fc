"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``.

A write to a client that went away raises ``ConnectionError``; the caller then stops the
generation (closing the engine streams aborts them).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from services.protocol.openai import OpenAIError

_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
}


def encode_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class SSEWriter:
    def __init__(self, request: web.Request, headers: dict[str, str]) -> None:
        self._request = request
        self.response = web.StreamResponse(status=200, headers={**_HEADERS, **headers})

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, obj: Any) -> None:
        await self.response.write(encode_event(obj))

    async def error(self, err: OpenAIError) -> None:
        """Ends a stream that already started, the way vLLM does: an error event, then DONE."""
        await self.response.write(encode_event(err.to_dict()))
        await self.response.write(DONE)

    async def done(self) -> None:
        await self.response.write(DONE)
        await self.response.write_eof()
