"""Smoke tests of the load test: request bodies, SSE timing, the report, and the locustfile.

The locustfile itself is imported in a child process: importing locust monkey-patches the
standard library with gevent, which must not happen inside the test process.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import run as loadtest_run
from loadtest.scenarios import (
    AgentSession,
    Corpus,
    Settings,
    chat_body,
    completion_body,
    consume_sse,
    rag_body,
)

REPO = Path(__file__).resolve().parents[2]
SETTINGS = Settings(model="m", max_tokens=7, prompt_scale=0.2, agent_turns=3)
CORPUS = Corpus.build(0.2)


def _check_stream_fields(body: dict) -> None:
    assert body["model"] == "m" and body["max_tokens"] == 7
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    json.dumps(body)  # serializable


def test_bodies_are_valid_openai_requests() -> None:
    rng = random.Random(0)
    chat = chat_body(SETTINGS, CORPUS, rng)
    _check_stream_fields(chat)
    assert [m["role"] for m in chat["messages"]] == ["system", "user"]
    assert chat["messages"][0]["content"] in CORPUS.system_prompts
    rag = rag_body(SETTINGS, CORPUS, rng)
    _check_stream_fields(rag)
    assert any(doc in rag["prompt"] for doc in CORPUS.documents)
    assert rag["prompt"].index("Context") < rag["prompt"].index("Question")  # shared part first
    short = completion_body(SETTINGS, rng)
    _check_stream_fields(short)
    assert 0 < len(short["prompt"].split()) <= 25


def test_agent_turns_extend_the_previous_context() -> None:
    session = AgentSession(SETTINGS, CORPUS, random.Random(1))
    previous: list[dict] = []
    for turn in range(SETTINGS.agent_turns):
        body = session.next_body()
        _check_stream_fields(body)
        msgs = body["messages"]
        assert msgs[: len(previous)] == previous  # every turn extends the one before
        assert msgs[-1]["role"] == "user"
        session.record_reply(f"answer {turn}")
        previous = [*msgs, {"role": "assistant", "content": f"answer {turn}"}]
    assert session.done


def test_consume_sse_times_tokens_and_reads_usage() -> None:
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 80},
    }
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}]},
        {"choices": [], "usage": usage},
    ]
    raw = (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )
    chunks = [raw[i : i + 7] for i in range(0, len(raw), 7)]  # split mid-line on purpose
    ticks = iter(float(t) for t in range(1, 100))
    res = consume_sse(chunks, start=0.0, clock=lambda: next(ticks))
    assert res.error is None and res.text == "Hello!"
    assert res.ttft_s == 1.0 and res.itls_s == [1.0, 1.0]
    assert (res.prompt_tokens, res.cached_tokens, res.completion_tokens) == (100, 80, 3)
    assert res.cache_hit_ratio == pytest.approx(0.8)
    # A completions stream (choices[].text) and an error event.
    err = b'data: {"choices": [{"text": "x"}]}\n\ndata: {"error": {"message": "boom"}}\n\n'
    res = consume_sse([err], start=0.0)
    assert res.text == "x" and res.error == "boom"


def test_report_from_request_log(tmp_path: Path) -> None:
    rows = [
        {
            "t": 1000.0 + i,
            "scenario": s,
            "ttft_s": 0.05 + i / 100,
            "itl_s": [0.01, 0.02],
            "e2e_s": 0.5,
            "prompt_tokens": 200,
            "cached_tokens": 150 if s == "agent" else 0,
            "completion_tokens": 8,
        }
        for i, s in enumerate(["agent", "chat", "rag", "completion"] * 5)
    ]
    table = loadtest_run.summary_table(rows, run_s=20.0)
    assert "| agent | 5 |" in table and "75.0%" in table
    out = tmp_path / "report.png"
    loadtest_run.plot_report(rows, out, "test")
    assert out.stat().st_size > 10_000
    assert loadtest_run.parse_seconds("1m30s") == 90 and loadtest_run.parse_seconds("20") == 20


def test_locustfile_user_classes_build_bodies() -> None:
    code = """
import json, sys
sys.path.insert(0, "loadtest")
import locustfile
from locust.env import Environment
classes = [locustfile.ChatUser, locustfile.AgentUser, locustfile.RAGUser, locustfile.CompletionUser]
env = Environment(user_classes=classes, host="http://127.0.0.1:9")
out = {}
for cls in classes:
    cls.host = env.host  # what the runner does with --host
    user = cls(env)
    user.on_start()
    out[cls.__name__] = [user.body(), user.body()]
print(json.dumps(out))
"""
    env = {
        "PAGODA_MODEL": "test-model",
        "PAGODA_MAX_TOKENS": "5",
        "PAGODA_PROMPT_SCALE": "0.1",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    bodies = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(bodies) == {"ChatUser", "AgentUser", "RAGUser", "CompletionUser"}
    for name, pair in bodies.items():
        for body in pair:
            assert body["model"] == "test-model" and body["max_tokens"] == 5, name
            assert body["stream"] is True and body["stream_options"]["include_usage"] is True
            assert ("messages" in body) != ("prompt" in body)
    first, second = bodies["AgentUser"]
    assert second["messages"][: len(first["messages"])] == first["messages"]
