"""Engines sized and warmed for their features (``memory_budget``, ``feature_warm_up``).

The pool: with the default budget, an engine with LoRA slots, or with a draft model, gets a
smaller pool than the same engine without, by exactly what the accounting holds back (and a
draft's own KV per block), and its requests still run to the end; an explicit
``kv_cache_memory`` is the pool's own size; the accounting's items match the tensors they
stand for.

The warm-up: each engine ran the paths of its features and no other (LoRA layout; the
verification, with the rejection sampler really called, and the draft model; the sampler's
paths everywhere), and the grammar masks (a GPU's warm-up) leave the logits as they were.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import feature_warm_up, memory_budget, model_runner
from services.engine.memory_budget import FeatureMemory
from services.engine.models.loader import load_model
from services.engine.spec_decode import verifier
from services.protocol.sampling_params import SamplingParams
from tests.support import spec_decode as sd

BUDGET = 16 * 1024**2  # the engine's memory in these tests (the CPU default is 2 GiB)
SMALL = {"max_num_seqs": 8, "max_num_batched_tokens": 32}
SAMPLER = ["sampler: greedy", "sampler: every feature"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _pool(runner) -> tuple[int, int, FeatureMemory]:
    """(blocks, bytes per block of both models' KV, what was held back)."""
    per_block = runner.kv_caches[0][0].nbytes * 2 * len(runner.kv_caches) // runner.num_blocks
    spec = runner.features.get(verifier.Verifier.name)
    if spec is not None and spec.draft is not None:
        draft = spec.draft.kv_caches
        per_block += draft[0][0].nbytes * 2 * len(draft) // runner.num_blocks
    return runner.num_blocks, per_block, runner.feature_memory


@pytest.fixture(scope="module")
def engines(tiny_model_dir) -> dict:
    """Per feature set: (pool, warmed paths, verify calls, greedy tokens, grammar warm-up)."""
    target = tiny_model_dir("LlamaForCausalLM")
    features = {"base": {}, "lora": {"enable_lora": True, "max_loras": 4, "max_lora_rank": 64},
                "draft": {"speculative_config": sd.draft(target)}}
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "_DEFAULT_CPU_KV_BYTES", BUDGET)
        mp.setenv(model_runner.SKIP_WARM_UP_ENV, "0")  # the warm-up is what this tests
        calls: list[int] = []
        real = verifier.verify
        mp.setattr(verifier, "verify", lambda *a: calls.append(1) or real(*a))
        for name, extra in features.items():
            config = {**SMALL, **extra}
            engine = sd.engine(target, config.pop("speculative_config", None), **config)
            try:
                runner = engine.runner
                out[name] = {"pool": _pool(runner), "warmed": runner.warmed_up,
                             "verify calls": len(calls),
                             "tokens": sd.run(engine, [[1, 2, 3, 4, 5]] * 3, GREEDY),
                             "lora reset": (lora := runner.features.get("lora")) is None
                             or lora.lora.state.step is None}
                if name == "draft":
                    out[name]["grammar"] = _grammar_warm_up(runner)
            finally:
                engine.close()
            calls.clear()
    return out


def _grammar_warm_up(runner) -> bool:
    warmed = feature_warm_up.warm_up_features(runner, grammar_masks=True)
    logits = torch.randn(3, runner.model_config.vocab_size)
    before = logits.clone()
    runner.masker.mask(logits, [0, 1, 2])  # the bitmask the warm-up left: all allowed
    return warmed[-1] == "grammar masks" and torch.equal(logits, before)


def test_features_that_take_memory_shrink_the_pool_and_requests_still_fit(engines) -> None:
    for name, e in engines.items():
        blocks, per_block, held = e["pool"]
        assert blocks == (BUDGET - held.total(torch.device("cpu"))) // per_block, name
        assert [len(t) for t in e["tokens"]] == [6, 6, 6]
    base, lora, draft = (engines[n]["pool"] for n in ("base", "lora", "draft"))
    assert lora[2].item("lora") > 0 and lora[0] < base[0]
    assert draft[2].item("draft_weights") > 0 and draft[2].item("draft_probs") > 0
    assert draft[0] < base[0]
    assert base[2].item("lora") == base[2].item("draft_weights") == 0


def test_the_warm_up_runs_every_enabled_features_path_and_no_other(engines) -> None:
    assert engines["base"]["warmed"] == SAMPLER
    assert engines["lora"]["warmed"] == ["LoRA layout", *SAMPLER]
    assert engines["draft"]["warmed"] == [*SAMPLER, "verification", "draft model"]
    assert [engines[n]["verify calls"] for n in ("base", "lora", "draft")] == [0, 0, 1]
    assert all(e["lora reset"] for e in engines.values())  # the warm-up's layout is gone
    assert engines["draft"]["grammar"]
    # The warmed paths changed nothing: the same greedy tokens with LoRA slots (all empty).
    assert engines["lora"]["tokens"] == engines["base"]["tokens"]


def test_skipping_the_warm_up_runs_no_feature_path_and_changes_no_token(
        engines, tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_runner, "_DEFAULT_CPU_KV_BYTES", BUDGET)
    monkeypatch.setenv(model_runner.SKIP_WARM_UP_ENV, "1")
    engine = sd.engine(tiny_model_dir("LlamaForCausalLM"), None, **SMALL)
    try:
        assert engine.runner.warmed_up == []
        assert sd.run(engine, [[1, 2, 3, 4, 5]] * 3, GREEDY) == engines["base"]["tokens"]
    finally:
        engine.close()


def test_an_explicit_kv_cache_memory_is_the_pools_own(tiny_model_dir) -> None:
    engine = sd.engine(tiny_model_dir("LlamaForCausalLM"), kv_cache_memory=BUDGET, **SMALL)
    try:
        blocks, per_block, held = _pool(engine.runner)
    finally:
        engine.close()
    assert held is None and blocks == BUDGET // per_block


def test_the_accounting_counts_the_tensors_it_stands_for(tiny_model_dir) -> None:
    path = tiny_model_dir("LlamaForCausalLM")
    model = load_model(path, torch.float32)
    params = sum(p.nbytes for p in model.parameters())
    assert memory_budget.weight_bytes(path, torch.float32) == params
    assert memory_budget.weight_bytes(path, torch.bfloat16) == params // 2
    assert memory_budget.sampler_bytes(8, 1000) == 8 * 1000 * 4 * memory_budget.SAMPLER_COPIES
    held = FeatureMemory(activations=1, sampler=2, reserved={"draft_weights": 4,
                                                             "draft_probs": 8},
                         held={"lora": 16})
    assert held.total(torch.device("cpu")) == 31
    assert held.total(torch.device("cuda")) == 15  # the slots are out of free memory already
