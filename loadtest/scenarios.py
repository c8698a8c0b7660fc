"""Request bodies and SSE measurement for the load test (no locust import: unit-testable).

Four kinds of traffic, each a user class in ``locustfile.py``:

    scenario    endpoint              prompt                                      expected hits
    ----------  --------------------  ------------------------------------------  -------------
    chat        /v1/chat/completions  one of 3 long system prompts + a question   system prompt
    agent       /v1/chat/completions  a session: every turn appends the previous  ~90% by the
                                      answer and a tool result to the context     later turns
    rag         /v1/completions       one of 4 long documents + a question        the document
    completion  /v1/completions       a short unique prompt                       none

Settings from the environment (``loadtest/run.py`` sets them from its flags):
``PAGODA_MODEL`` (default SmolLM2-135M-Instruct), ``PAGODA_MAX_TOKENS`` (32),
``PAGODA_PROMPT_SCALE`` (1.0: multiplies every long text's length), ``PAGODA_AGENT_TURNS`` (8).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

_WORDS = [
    "the",
    "service",
    "routes",
    "each",
    "request",
    "to",
    "an",
    "engine",
    "that",
    "already",
    "holds",
    "the",
    "longest",
    "cached",
    "prefix",
    "of",
    "its",
    "prompt",
    "while",
    "balancing",
    "load",
    "across",
    "the",
    "fleet",
    "so",
    "that",
    "no",
    "single",
    "replica",
    "becomes",
    "a",
    "hot",
    "spot",
    "during",
    "bursts",
    "of",
    "traffic",
    "from",
    "many",
    "tenants",
    "sharing",
    "long",
    "system",
    "prompts",
    "documents",
    "tools",
    "and",
    "conversation",
    "history",
    "which",
    "must",
    "stay",
    "consistent",
    "between",
    "turns",
    "and",
    "across",
    "restarts",
    "of",
    "the",
    "gateway",
    "router",
    "and",
    "workers",
    "in",
    "every",
    "region",
    "of",
    "the",
    "cluster",
    "where",
    "operators",
    "watch",
    "latency",
    "throughput",
    "memory",
    "usage",
    "and",
    "the",
    "ratio",
    "of",
    "cached",
    "tokens",
    "to",
    "prompt",
    "tokens",
    "reported",
    "by",
    "the",
    "metrics",
    "endpoint",
    "of",
    "every",
    "process",
]


@dataclass(frozen=True, slots=True)
class Settings:
    model: str = "SmolLM2-135M-Instruct"
    max_tokens: int = 32
    prompt_scale: float = 1.0
    agent_turns: int = 8

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        d = cls()
        return cls(
            model=e.get("PAGODA_MODEL", d.model),
            max_tokens=int(e.get("PAGODA_MAX_TOKENS", d.max_tokens)),
            prompt_scale=float(e.get("PAGODA_PROMPT_SCALE", d.prompt_scale)),
            agent_turns=int(e.get("PAGODA_AGENT_TURNS", d.agent_turns)),
        )


def text(words: int, seed: int) -> str:
    """Deterministic pseudo-prose of ``words`` words (about 1.2 tokens a word)."""
    rng = random.Random(seed)
    out = []
    for i in range(max(1, words)):
        w = rng.choice(_WORDS)
        out.append(w.capitalize() + "." if i % 17 == 16 else w)
    return " ".join(out)


def _scaled(words: int, scale: float) -> int:
    return max(8, round(words * scale))


@dataclass(slots=True)
class Corpus:
    """The shared long texts: a few system prompts and documents, built once per process."""

    system_prompts: list[str]
    documents: list[str]
    agent_system: str

    @classmethod
    def build(cls, scale: float = 1.0) -> Corpus:
        return cls(
            system_prompts=[
                f"You are assistant #{i} of the support team. Policy: "
                + text(_scaled(700, scale), 100 + i)
                for i in range(3)
            ],
            documents=[f"Document {i}.\n" + text(_scaled(900, scale), 200 + i) for i in range(4)],
            agent_system="You are an agent that uses tools to solve the task step by step. "
            + text(_scaled(400, scale), 300),
        )


def _stream_fields(settings: Settings) -> dict[str, Any]:
    return {
        "model": settings.model,
        "max_tokens": settings.max_tokens,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat_body(settings: Settings, corpus: Corpus, rng: random.Random) -> dict[str, Any]:
    system = rng.choice(corpus.system_prompts)
    question = text(rng.randint(8, 30), rng.randrange(1 << 30)) + "?"
    return {
        **_stream_fields(settings),
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }


def rag_body(settings: Settings, corpus: Corpus, rng: random.Random) -> dict[str, Any]:
    # Zipf-like popularity: the first documents are asked about most.
    doc = rng.choices(corpus.documents, weights=[1 / (i + 1) for i in range(len(corpus.documents))])
    question = text(rng.randint(6, 20), rng.randrange(1 << 30))
    prompt = f"Answer from the context.\n\nContext:\n{doc[0]}\n\nQuestion: {question}?\nAnswer:"
    return {**_stream_fields(settings), "prompt": prompt}


def completion_body(settings: Settings, rng: random.Random) -> dict[str, Any]:
    return {**_stream_fields(settings), "prompt": text(rng.randint(5, 25), rng.randrange(1 << 30))}


@dataclass(slots=True)
class AgentSession:
    """A multi-turn agent conversation: each turn's prompt extends the previous turn's prompt
    and answer, so everything but the newest tool output can come from the prefix cache."""

    settings: Settings
    corpus: Corpus
    rng: random.Random
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0

    def __post_init__(self) -> None:
        task = text(self.rng.randint(30, 60), self.rng.randrange(1 << 30))
        self.messages = [
            {"role": "system", "content": self.corpus.agent_system},
            {"role": "user", "content": f"Task: {task}."},
        ]

    @property
    def done(self) -> bool:
        return self.turn >= self.settings.agent_turns

    def next_body(self) -> dict[str, Any]:
        if self.turn > 0:
            words = _scaled(self.rng.randint(40, 120), self.settings.prompt_scale)
            result = text(words, self.rng.randrange(1 << 30))
            self.messages.append({"role": "user", "content": f"Tool output:\n{result}"})
        self.turn += 1
        return {**_stream_fields(self.settings), "messages": list(self.messages)}

    def record_reply(self, reply: str) -> None:
        # An empty answer would be a message the template renders oddly; keep a placeholder.
        self.messages.append({"role": "assistant", "content": reply or "(no output)"})


# -- streaming ---------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamResult:
    ttft_s: float = math.nan  # first chunk carrying text
    itls_s: list[float] = field(default_factory=list)  # gaps between text chunks
    e2e_s: float = math.nan
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    @property
    def cache_hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan


def _chunk_text(obj: dict[str, Any]) -> str:
    out = []
    for choice in obj.get("choices") or ():
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if piece:
            out.append(piece)
    return "".join(out)


def consume_sse(
    chunks: Iterable[bytes], start: float, clock: Callable[[], float] = time.perf_counter
) -> StreamResult:
    """Reads an OpenAI SSE stream (``data: {...}`` events, ``data: [DONE]``) as its bytes
    arrive and times it from ``start`` (a ``clock()`` value)."""
    res = StreamResult()
    buf = b""
    last = math.nan
    pieces: list[str] = []
    for chunk in chunks:
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                res.error = f"malformed SSE data: {payload[:80]!r}"
                continue
            if "error" in obj:
                res.error = str(obj["error"].get("message", obj["error"]))[:200]
                continue
            piece = _chunk_text(obj)
            if piece:
                now = clock()
                if math.isnan(res.ttft_s):
                    res.ttft_s = now - start
                else:
                    res.itls_s.append(now - last)
                last = now
                pieces.append(piece)
            if obj.get("usage"):
                res.usage = obj["usage"]
    res.e2e_s = clock() - start
    res.text = "".join(pieces)
    if res.error is None and not res.usage:
        res.error = "stream ended without a usage chunk"
    return res
