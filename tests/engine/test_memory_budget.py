"""The KV pool is sized after every enabled feature's memory (``memory_budget``).

With the default budget, an engine with LoRA slots, or with a draft model, gets a smaller pool
than the same engine without, by exactly what the accounting holds back (and a draft's own KV
per block), and its requests still run to the end; an explicit ``kv_cache_memory`` is the
pool's own size. The accounting's items are checked against the tensors they stand for.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import memory_budget, model_runner
from services.engine.memory_budget import FeatureMemory
from services.engine.models.loader import load_model
from services.protocol.sampling_params import SamplingParams
from tests.support import spec_decode as sd

BUDGET = 16 * 1024**2  # the engine's memory in these tests (the CPU default is 2 GiB)
SMALL = {"max_num_seqs": 8, "max_num_batched_tokens": 32}


@pytest.fixture
def small_budget(monkeypatch):
    monkeypatch.setattr(model_runner, "_DEFAULT_CPU_KV_BYTES", BUDGET)


def _pool(engine) -> tuple[int, int, FeatureMemory]:
    """(blocks, bytes per block of both models' KV, what was held back)."""
    runner = engine.runner
    per_block = runner.kv_caches[0][0].nbytes * 2 * len(runner.kv_caches) // runner.num_blocks
    if runner.draft is not None:
        draft = runner.draft.kv_caches
        per_block += draft[0][0].nbytes * 2 * len(draft) // runner.num_blocks
    return runner.num_blocks, per_block, runner.feature_memory


def _finishes(engine) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = sd.run(engine, [[1, 2, 3, 4, 5]] * 3, params)
    assert [len(o) for o in out] == [6, 6, 6]


@pytest.mark.usefixtures("small_budget")
def test_features_that_take_memory_shrink_the_pool_and_requests_still_fit(tiny_model_dir):
    target = tiny_model_dir("LlamaForCausalLM")
    pools = {}
    for name, extra in {"base": {}, "lora": {"enable_lora": True, "max_loras": 4,
                                              "max_lora_rank": 64},
                        "draft": {"speculative_config": sd.draft(target)}}.items():
        config = {**SMALL, **extra}
        spec = config.pop("speculative_config", None)
        engine = sd.engine(target, spec, **config)
        try:
            pools[name] = _pool(engine)
            _finishes(engine)
        finally:
            engine.close()
    for name, (blocks, per_block, held) in pools.items():
        assert blocks == (BUDGET - held.total(torch.device("cpu"))) // per_block, name
    base, lora, draft = pools["base"], pools["lora"], pools["draft"]
    assert lora[2].lora_slots > 0 and lora[0] < base[0]
    assert draft[2].draft_weights > 0 and draft[2].draft_probs > 0 and draft[0] < base[0]
    assert base[2].lora_slots == base[2].draft_weights == 0


def test_an_explicit_kv_cache_memory_is_the_pools_own(tiny_model_dir) -> None:
    engine = sd.engine(tiny_model_dir("LlamaForCausalLM"), kv_cache_memory=BUDGET, **SMALL)
    try:
        blocks, per_block, held = _pool(engine)
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
    held = FeatureMemory(activations=1, sampler=2, draft_weights=4, draft_probs=8,
                         lora_slots=16)
    assert held.total(torch.device("cpu")) == 31
    assert held.total(torch.device("cuda")) == 15  # the slots are out of free memory already
