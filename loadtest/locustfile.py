"""Pagoda load test: four kinds of streaming users against the OpenAI-compatible gateway.

    .venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000        # web UI
    .venv/bin/python loadtest/run.py --users 8 --run-time 60s                     # headless

User classes (see ``scenarios.py`` for the prompts): ``ChatUser``, ``AgentUser``, ``RAGUser``,
``CompletionUser``; equal weights (name some of them after the locust flags to run only those).
Every request streams; besides locust's own row for the HTTP request (its time is the time to
the response headers), each request fires custom metrics, one locust row per type and
scenario:

    TTFT    time to the first streamed text, ms
    ITL     every gap between two streamed text chunks, ms
    E2E     time to the end of the stream, ms (response_length = completion tokens)
    CACHE%  cached_tokens / prompt_tokens x 100 of that request (shown as its "time")

With ``PAGODA_LOADTEST_LOG=path`` every request is also written as one JSON line (the report
of ``run.py`` is made from it); ``PAGODA_LOADTEST_AUTH="Bearer KEY"`` authenticates.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from locust import HttpUser, between, events, task

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenarios import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    AgentSession,
    Corpus,
    Settings,
    StreamResult,
    chat_body,
    completion_body,
    consume_sse,
    rag_body,
)

SETTINGS = Settings.from_env()
CORPUS = Corpus.build(SETTINGS.prompt_scale)
_LOG_PATH = os.environ.get("PAGODA_LOADTEST_LOG")
_log_file = open(_LOG_PATH, "a", buffering=1) if _LOG_PATH else None  # noqa: SIM115


@events.quitting.add_listener
def _close_log(**_: Any) -> None:
    if _log_file is not None:
        _log_file.close()


class StreamingUser(HttpUser):
    """Posts a streaming request and reports TTFT, ITL, E2E and the cache-hit ratio."""

    abstract = True
    scenario = "base"

    def on_start(self) -> None:
        self.rng = random.Random()
        auth = os.environ.get("PAGODA_LOADTEST_AUTH")  # "Bearer KEY" (run.py --api-key)
        if auth:
            self.client.headers["Authorization"] = auth

    def stream(self, path: str, body: dict[str, Any]) -> StreamResult | None:
        start_wall = time.time()
        start = time.perf_counter()
        with self.client.post(
            path, json=body, stream=True, catch_response=True, name=f"{path} [{self.scenario}]"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return None
            try:
                result = consume_sse(resp.iter_content(chunk_size=None), start)
            except Exception as exc:  # noqa: BLE001 -- a broken stream is a failed request
                resp.failure(f"stream broke: {exc!r}")
                return None
            if result.error:
                resp.failure(result.error)
                return None
            resp.success()
        self._report(result, start_wall)
        return result

    def _fire(self, kind: str, value_ms: float, length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=self.scenario,
            response_time=value_ms,
            response_length=length,
            exception=None,
            context={},
        )

    def _report(self, r: StreamResult, start_wall: float) -> None:
        if not math.isnan(r.ttft_s):
            self._fire("TTFT", r.ttft_s * 1000)
        for gap in r.itls_s:
            self._fire("ITL", gap * 1000)
        self._fire("E2E", r.e2e_s * 1000, r.completion_tokens)
        if r.prompt_tokens:
            self._fire("CACHE%", 100 * r.cache_hit_ratio)
        if _log_file is not None:
            row = {
                "t": start_wall,
                "scenario": self.scenario,
                "ttft_s": None if math.isnan(r.ttft_s) else r.ttft_s,
                "itl_s": r.itls_s,
                "e2e_s": r.e2e_s,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "completion_tokens": r.completion_tokens,
            }
            _log_file.write(json.dumps(row) + "\n")


class ChatUser(StreamingUser):
    """Chat users of a few products: each product's long system prompt is shared."""

    scenario = "chat"
    wait_time = between(0.5, 2.0)

    def body(self) -> dict[str, Any]:
        return chat_body(SETTINGS, CORPUS, self.rng)

    @task
    def chat(self) -> None:
        self.stream(CHAT_PATH, self.body())


class AgentUser(StreamingUser):
    """A multi-turn agent: every turn extends the previous context (answer + tool output)."""

    scenario = "agent"
    wait_time = between(0.1, 0.5)  # tool latency between turns

    def on_start(self) -> None:
        super().on_start()
        self.session = AgentSession(SETTINGS, CORPUS, self.rng)

    def body(self) -> dict[str, Any]:
        if self.session.done:
            self.session = AgentSession(SETTINGS, CORPUS, self.rng)
        return self.session.next_body()

    @task
    def turn(self) -> None:
        result = self.stream(CHAT_PATH, self.body())
        if result is None:  # a failed turn ends the session
            self.session = AgentSession(SETTINGS, CORPUS, self.rng)
        else:
            self.session.record_reply(result.text)


class RAGUser(StreamingUser):
    """Questions over a small set of long documents (document first, question last)."""

    scenario = "rag"
    wait_time = between(0.5, 2.0)

    def body(self) -> dict[str, Any]:
        return rag_body(SETTINGS, CORPUS, self.rng)

    @task
    def ask(self) -> None:
        self.stream(COMPLETIONS_PATH, self.body())


class CompletionUser(StreamingUser):
    """Plain short completions: nothing to share."""

    scenario = "completion"
    wait_time = between(0.5, 2.0)

    def body(self) -> dict[str, Any]:
        return completion_body(SETTINGS, self.rng)

    @task
    def complete(self) -> None:
        self.stream(COMPLETIONS_PATH, self.body())
