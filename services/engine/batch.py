"""Offline batch job in OpenAI's batch-file format.

    python -m services.engine.batch IN.jsonl OUT.jsonl [--model PATH] [engine flags]

The engine flags are the engine server's (``EngineConfig``: ``--dtype``, ``--max-num-seqs``,
``--num-blocks``...), read by the one CLI scheme (``services.common.cli``).

Each input line is ``{"custom_id": ..., "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}``. Every line gets exactly one output line, in input
order: a response, or an error record for a bad line. Nothing is silently dropped. All good
lines run together, so continuous batching keeps the engine full.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common import cli
from services.common.cli import flag
from services.common.logs import setup_logging
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.outputs import RequestOutput
from services.protocol import openai as oa

logger = logging.getLogger(__name__)

_ENDPOINTS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


@dataclass(slots=True)
class _Job:
    line_no: int
    custom_id: str | None
    request: oa.GenerationRequest | None = None
    error: oa.OpenAIError | None = None
    prompts: list[tuple[str | None, list[int]]] | None = None


def parse_line(line_no: int, line: str) -> _Job:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return _Job(line_no, None, error=oa.OpenAIError(f"line {line_no}: invalid JSON: {exc}"))
    custom_id = record.get("custom_id") if isinstance(record, dict) else None
    try:
        if not isinstance(record, dict):
            raise oa.OpenAIError("each line must be a JSON object")
        if not isinstance(custom_id, str) or not custom_id:
            raise oa.OpenAIError("custom_id is required", param="custom_id")
        if record.get("method", "POST") != "POST":
            raise oa.OpenAIError("method must be POST", param="method")
        kind = _ENDPOINTS.get(record.get("url"))
        if kind is None:
            raise oa.OpenAIError(f"url must be one of {sorted(_ENDPOINTS)}", param="url")
        body = record.get("body")
        parse = oa.parse_chat_request if kind == "chat" else oa.parse_completion_request
        req = parse(body)
        if req.stream:
            raise oa.OpenAIError("stream is not supported in a batch", param="stream")
        if req.constraint.tools is not None:  # the tool-call parsers live in the gateway
            raise oa.OpenAIError("tools are not supported in a batch", param="tools")
        return _Job(line_no, custom_id, request=req)
    except oa.OpenAIError as exc:
        return _Job(line_no, custom_id, error=exc)


def _encode(llm: LLM, job: _Job) -> None:
    """Tokenizes the job and checks it against the engine's limits (errors stay per line)."""
    req = job.request
    tok = llm.get_tokenizer()
    try:
        if req.kind == "chat":
            text = tok.apply_chat_template(req.messages, **req.chat_template_kwargs)
            prompts = [(text, tok.encode(text, add_special_tokens=False))]
        else:
            prompts = [(p, tok.encode(p)) if isinstance(p, str) else (None, p) for p in req.prompts]
        for _, ids in prompts:
            llm.engine.check_request(ids, req.params)
        job.prompts = prompts
    except ValueError as exc:
        job.error = oa.OpenAIError(str(exc))


def run_batch(llm: LLM, lines: list[str], use_tqdm: bool = True) -> list[dict[str, Any]]:
    jobs = [parse_line(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    for job in jobs:
        if job.error is None:
            _encode(llm, job)
    good = [j for j in jobs if j.error is None]
    flat = [(j, text, ids) for j in good for text, ids in j.prompts]
    outputs = llm.run_encoded(  # one engine run for every line: continuous batching across lines
        [(text, ids) for _, text, ids in flat],
        [j.request.params for j, _, _ in flat],
        use_tqdm,
        None,
    ) if flat else []
    per_job: dict[int, list[RequestOutput]] = {}
    for (job, _, _), out in zip(flat, outputs, strict=True):
        per_job.setdefault(job.line_no, []).append(out)
    return [_record(llm, job, per_job.get(job.line_no, [])) for job in jobs]


def _record(llm: LLM, job: _Job, outs: list[RequestOutput]) -> dict[str, Any]:
    rid = oa.new_id("batch_req")
    if job.error is not None:
        return {
            "id": rid,
            "custom_id": job.custom_id,
            "response": {"status_code": job.error.status, "request_id": rid,
                         "body": job.error.to_dict()},
            "error": {"code": job.error.code or job.error.type, "message": job.error.message},
        }
    body = _response_body(llm, job.request, outs)
    return {
        "id": rid,
        "custom_id": job.custom_id,
        "response": {"status_code": 200, "request_id": body["id"], "body": body},
        "error": None,
    }


def _response_body(llm: LLM, req: oa.GenerationRequest, outs: list[RequestOutput]) -> dict:
    choices = []
    n = req.params.n
    for p_idx, out in enumerate(outs):
        for c in out.outputs:
            index = p_idx * n + c.index
            if req.kind == "chat":
                choices.append({
                    "index": index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
            else:
                text = (out.prompt or "") + c.text if req.echo else c.text
                choices.append({
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    use = oa.usage(prompt_tokens, completion_tokens, cached)
    build = oa.chat_object if req.kind == "chat" else oa.completion_object
    model = req.model or llm.engine.model_name
    return build(oa.new_id("chatcmpl" if req.kind == "chat" else "cmpl"), model, choices, use)


PROG = "python -m services.engine.batch"


@dataclass(frozen=True, slots=True)
class BatchFiles:
    """The job's own arguments; every other flag is the engine's."""

    input: Path = flag(help="OpenAI batch input (.jsonl)", positional=True, parse=Path)
    output: Path = flag(
        help="where to write one result line per input line", positional=True, parse=Path
    )


def args_from(argv: Sequence[str] | None = None) -> tuple[BatchFiles, EngineConfig]:
    """The files and the engine's config from one command line; exits 2 on a bad flag."""
    parser = cli.build_parser(BatchFiles, EngineConfig, prog=PROG,
                              description=__doc__.split("\n\n")[0])
    ns = parser.parse_args(argv)
    return cli.from_namespace(BatchFiles, ns, parser), cli.from_namespace(EngineConfig, ns, parser)


def main(argv: Sequence[str] | None = None) -> int:
    files, engine = args_from(argv)
    setup_logging("INFO", "batch")
    lines = files.input.read_text().splitlines()
    llm = LLM(**{f.name: getattr(engine, f.name) for f in dataclasses.fields(engine) if f.init})
    records = run_batch(llm, lines)
    with files.output.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    failed = sum(rec["error"] is not None for rec in records)
    logger.info("batch done: lines=%d ok=%d failed=%d", len(records), len(records) - failed, failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
