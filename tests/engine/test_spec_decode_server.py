"""The engine server with ``--speculative-config`` (a real process, its engine core in its own
process): a step's accepted tokens stream as one frame, the tokens equal speculation off, and
``/metrics`` carries vLLM's four speculative-decoding families with their invariants."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from services.protocol import engine_api
from services.protocol.sampling_params import SamplingParams
from tests.support import spec_decode as sd
from tests.support.services import ServiceProcess, internal_headers

PROMPT = [5, 9, 13, 5, 9, 13, 5, 9, 13, 5]


async def _tokens_frames(url: str, rid: str) -> list[engine_api.TokensFrame]:
    body = engine_api.GenerateRequest(rid, PROMPT, SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True)).to_msgpack()
    frames, dec = [], engine_api.FrameDecoder()
    async with aiohttp.ClientSession(headers=internal_headers()) as s, s.post(
            url + engine_api.GENERATE_PATH, data=body) as r:
        assert r.status == 200, await r.text()
        async for chunk in r.content.iter_any():
            frames.extend(dec.feed(chunk))
    return [f for f in frames if isinstance(f, engine_api.TokensFrame)]


def test_frames_tokens_and_vllm_metrics(tiny_model_dir) -> None:
    path = tiny_model_dir("LlamaForCausalLM")
    eng = sd.engine(path, num_blocks=64)
    want = sd.run(eng, [PROMPT], sd.greedy(24))[0]
    eng.close()
    spec = json.dumps(sd.draft(path))
    with ServiceProcess("services.engine.serving.server",
                        ["--model", str(path), "--num-blocks", "64",
                         "--speculative-config", spec]) as proc:
        frames = asyncio.run(_tokens_frames(proc.url, "a"))
        with urllib.request.urlopen(proc.url + "/metrics") as r:
            text = r.read().decode()
    assert [t for f in frames for t in f.token_ids] == want
    # 3 accepted drafts and the bonus arrive in one frame (a reader slower than the steps may
    # get two steps' worth in one)
    assert max(len(f.token_ids) for f in frames) >= 4
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(text)
               if family.name.startswith("vllm:spec_decode")
               for s in family.samples if s.name.endswith("_total")}
    drafts = samples["vllm:spec_decode_num_drafts_total", None]
    drafted = samples["vllm:spec_decode_num_draft_tokens_total", None]
    accepted = samples["vllm:spec_decode_num_accepted_tokens_total", None]
    per_pos = [samples["vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p)]
               for p in range(3)]
    assert drafts > 0 and drafted == accepted == 3 * drafts  # the target drafts for itself
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert 'model_name="' in text and 'engine="0"' in text
