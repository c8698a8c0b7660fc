"""The persistent input batch: rows written once, appended to, compacted; what it gathers for a
step equals the reference built from plain rows; and the step thread is never handed anything
the engine thread goes on changing."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.input_batch import InputBatch
from services.engine.logit_bias import LogitBias
from services.engine.model_runner import ModelRunner
from services.engine.request import Request
from services.engine.sampler import make_generator
from services.engine.sampling_batch import SamplingBatch, SamplingRequest
from services.engine.spec_decode.config import SpeculativeConfig
from services.engine.spec_decode.verifier import Verifier
from services.engine.step_features import StepFeatures
from services.protocol.block_hash import BlockHasher
from services.protocol.sampling_params import SamplingParams

VOCAB = 64
EOS = (2,)
HASHER = BlockHasher("test-model", 4)


def _request(rid: str, draw: int, **params: object) -> Request:
    rng = random.Random(draw)
    p = SamplingParams(**params)
    req = Request(rid, [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))], p, HASHER,
                  16, eos_token_ids=EOS,
                  generator=None if p.seed is None else make_generator(p.seed),
                  logit_bias=LogitBias.build(p.logit_bias, torch.device("cpu")))
    for _ in range(rng.randint(0, 5)):
        req.append_output_token(rng.randrange(VOCAB))
    return req


KINDS = [
    {"temperature": 0.0},
    {"temperature": 0.7, "top_p": 0.9, "seed": 3},
    {"temperature": 1.2, "top_k": 5, "min_p": 0.1, "logprobs": 2},
    {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.2},
    {"temperature": 0.9, "presence_penalty": -0.5, "min_tokens": 12, "stop_token_ids": [7, 99]},
    {"temperature": 0.0, "logit_bias": {5: 3.0, 9: -2.0}, "logprobs": 0},
]


def _reference(reqs: list[Request]) -> SamplingBatch:
    rows = [SamplingRequest(r.params, r.prompt_token_ids, list(r.output_token_ids), r.generator,
                            r.eos_token_ids, r.logit_bias) for r in reqs]
    return SamplingBatch.from_requests(rows, VOCAB)


def _same(got: object, want: object) -> bool:
    if isinstance(got, np.ndarray) or isinstance(want, np.ndarray):
        return np.array_equal(np.asarray(got), np.asarray(want))
    if isinstance(got, torch.Tensor):
        return torch.equal(got, want)
    if dataclasses.is_dataclass(got):
        return type(got) is type(want) and all(
            _same(getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(got))
    if isinstance(got, list | tuple):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want, strict=True))
    return got == want


def test_gathered_rows_equal_the_reference_as_requests_come_and_go() -> None:
    batch = InputBatch(max_rows=8, max_blocks_per_seq=6, vocab_size=VOCAB,
                       device=torch.device("cpu"))
    rng = random.Random(0)
    live: list[Request] = []
    blocks: dict[str, list[int]] = {}
    for i in range(60):
        if live and (len(live) == 8 or rng.random() < 0.4):
            batch.remove(live.pop(rng.randrange(len(live))))
        else:
            req = _request(f"r{i}", i, **KINDS[i % len(KINDS)])
            blocks[req.request_id] = [rng.randrange(100) for _ in range(rng.randint(1, 3))]
            batch.add(req, blocks[req.request_id])
            live.append(req)
        for req in live:  # a step: new blocks and tokens for some
            if rng.random() < 0.3 and len(blocks[req.request_id]) < 6:
                blocks[req.request_id].append(rng.randrange(100))
            if rng.random() < 0.5:
                req.append_output_token(rng.randrange(VOCAB))
            batch.refresh(req, blocks[req.request_id])
        # Rows stay packed, each request knows its own.
        assert batch.num_rows == len(live)
        assert sorted(r.batch_row for r in live) == list(range(len(live)))
        for req in live:
            ids = blocks[req.request_id]
            assert batch.block_table[req.batch_row, : len(ids)].tolist() == ids
            assert batch.num_blocks[req.batch_row] == len(ids)
        order = rng.sample(live, len(live))
        got = batch.sampling_batch(np.array([r.batch_row for r in order], dtype=np.int64))
        assert _same(got, _reference(order)), i


def test_drafts_and_the_draft_models_progress_move_with_their_rows() -> None:
    # The verifier holds them, following the batch's rows.
    held = Verifier(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}),
                    6, torch.device("cpu"))
    batch = InputBatch(6, 4, VOCAB, torch.device("cpu"), features=StepFeatures([held]))
    reqs = [_request(f"d{i}", i, temperature=0.0) for i in range(5)]
    for i, req in enumerate(reqs):
        batch.add(req, [i])
        assert held.draft_computed[req.batch_row] == -1  # joined: the draft has seen nothing
        held.hold(req.batch_row, [10 * i, 10 * i + 1, 10 * i + 2])
        held.draft_computed[req.batch_row] = 7 + i
    batch.remove(reqs[1])  # the last row moves into its place
    batch.remove(reqs[3])
    for i in (0, 2, 4):
        row = reqs[i].batch_row
        assert held.drafts_of(row, 3) == [10 * i, 10 * i + 1, 10 * i + 2]
        assert held.draft_computed[row] == 7 + i
    # min_tokens at a verified position counts the drafts before it as output
    req = _request("m", 99, temperature=0.0, min_tokens=7, stop_token_ids=[7])
    batch.add(req, [9])
    n = len(req.output_token_ids)
    rows = np.full(4, req.batch_row)
    banned = batch.sampling_batch(rows, ahead=np.arange(4)).banned
    assert sorted(set(banned[0])) == [i for i in range(4) if n + i < 7]


def test_rows_of_a_batch_without_options_cost_nothing_to_gather() -> None:
    batch = InputBatch(4, 2, VOCAB, torch.device("cpu"))
    for i in range(3):
        batch.add(_request(f"g{i}", i, temperature=0.0), [i])
    got = batch.sampling_batch(np.arange(3))
    assert got.all_greedy and got.logprobs is None and got.penalties is None
    assert got.banned is None and got.logit_bias is None and got.truncation is None


# -- the step thread -----------------------------------------------------------------------------


def _lists_of(requests: list[Request]) -> dict[int, str]:
    """id -> name of every list a request owns (what the engine thread appends to)."""
    out = {}
    for req in requests:
        for name in ("token_ids", "prompt_token_ids", "prompt_logprobs", "block_hashes"):
            out[id(getattr(req, name))] = f"{req.request_id}.{name}"
        for name in ("stop_token_ids", "stop"):
            out[id(getattr(req.params, name))] = f"{req.request_id}.params.{name}"
    return out


def _reachable(obj: object, seen: set[int] | None = None):
    """Every container and dataclass reachable from ``obj`` (tensors, arrays, generators and
    grammar states are leaves)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, list | tuple | set | frozenset):
        for item in obj:
            yield from _reachable(item, seen)
    elif isinstance(obj, dict):
        for item in (*obj.keys(), *obj.values()):
            yield from _reachable(item, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _reachable(getattr(obj, f.name), seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("services."):
        for item in vars(obj).values():
            yield from _reachable(item, seen)


@pytest.mark.parametrize("spec", ["off", "ngram", "draft_model"])
def test_the_step_thread_gets_nothing_the_engine_thread_appends_to(spec, tiny_model_dir,
                                                                   monkeypatch) -> None:
    """Async scheduling: what ``run`` (the step thread) is handed holds no request and no list
    a request owns, whatever the features in use (speculative decoding's drafts, verification
    inputs and draft passes too); it would fail if the sampler were given a request's output
    list again."""
    path = tiny_model_dir("LlamaForCausalLM")
    speculative = {"off": None,
                   "ngram": {"method": "ngram", "num_speculative_tokens": 2,
                             "prompt_lookup_min": 1},
                   "draft_model": {"method": "draft_model", "model": str(path),
                                   "num_speculative_tokens": 2}}[spec]
    engine = LLMEngine(EngineConfig(model=str(path), num_blocks=64, async_scheduling=True,
                                    max_num_seqs=8, speculative_config=speculative))
    handed: list[object] = []
    run = ModelRunner.run

    def spying(self, step, tokens=None):
        handed.append(step)
        return run(self, step, tokens)

    monkeypatch.setattr(ModelRunner, "run", spying)
    kinds = KINDS + [{"temperature": 0.0, "prompt_logprobs": 2}]
    for i, params in enumerate(kinds * 2):
        engine.add_request(f"r{i}", [3 + i, 4, 5, 6, 7, 8, 3 + i, 4, 5][: 2 + i % 8],
                           SamplingParams(max_tokens=14, ignore_eos=True, **params))
    everyone = list(engine.requests.values())
    owned = _lists_of(everyone)
    while engine.has_unfinished_requests():
        engine.step()
    assert handed
    if speculative is not None:
        assert engine.stats().spec_decode.num_drafts > 0
        assert any((verify := step.state.get(Verifier.name)) is not None
                   and verify.spec is not None for step in handed)
    for step in handed:
        for obj in _reachable(step):
            assert not isinstance(obj, Request), "a request reached the step thread"
            assert id(obj) not in owned, f"{owned[id(obj)]} reached the step thread"
    assert engine.runner.input_batch.num_rows == 0  # every row given back
    engine.close()
