"""The profiling run (issue 36, section 3): the largest step measured before the KV pool is
sized, with ``PAGODA_PROFILE_RUN=1``. On the CPU the meter is ``TensorPeak`` (the storages
torch operations create); ``CudaPeak`` runs where CUDA does."""

from __future__ import annotations

import pytest
import torch

from services.engine import model_runner, profile_run
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.protocol.sampling_params import SamplingParams

MB = 1_000_000


def test_tensor_peak_counts_what_the_operations_create_and_free() -> None:
    before = torch.ones(2_000_000)  # 8 MB made outside: never counted
    with profile_run.TensorPeak() as meter:
        a = torch.ones(1000, 1000)  # 4 MB
        b = a @ a  # 4 MB
        c = torch.cat([a, b])  # 8 MB: 16 MB at once
        del a, b
        c.add_(1)  # in place: nothing new
        row = c[0]  # a view: nothing new
        before.mul_(2)
        d = torch.ones(500, 1000)  # 2 MB beside c: 10 MB, under the peak
        del row, c, d
    assert meter.peak == 16 * MB


def test_tensor_peak_sees_a_temporary_inside_one_expression() -> None:
    x = torch.ones(1000, 1000)
    with profile_run.TensorPeak() as meter:
        y = (x * 2).sum()  # a 4 MB temporary, freed before the sum's result is kept
    assert meter.peak == 4 * MB + y.untyped_storage().nbytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator's peak: CUDA")
def test_cuda_peak_counts_the_allocators_peak() -> None:
    device = torch.device("cuda")
    with profile_run.CudaPeak(device) as meter:
        a = torch.ones(1_000_000, device=device)  # 4 MB
        b = a * 2
        del a, b
    assert 8 * MB <= meter.peak < 9 * MB


def _engine(path, monkeypatch, profiled: bool, **config) -> LLMEngine:
    monkeypatch.setenv(profile_run.PROFILE_RUN_ENV, "1" if profiled else "0")
    monkeypatch.setattr(model_runner, "_DEFAULT_CPU_KV_BYTES", BUDGET)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", **config))


BUDGET = 64 * 2**20
STEP = {"max_num_seqs": 8, "max_num_batched_tokens": 512}


def _greedy(engine: LLMEngine) -> list[int]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(1, 40)), params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for update in engine.step():
            tokens += update.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("LlamaForCausalLM", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def by_shapes(model) -> dict:
    """The pool and greedy tokens of an engine that counts from shapes (the default)."""
    with pytest.MonkeyPatch.context() as mp:
        engine = _engine(model, mp, False, **STEP)
    try:
        runner = engine.runner
        per_block = runner.kv_caches[0][0].nbytes * 2 * len(runner.kv_caches) // runner.num_blocks
        return {"memory": runner.feature_memory, "per_block": per_block,
                "tokens": _greedy(engine)}
    finally:
        engine.close()


def test_the_pool_is_sized_after_the_measured_step(model, by_shapes, monkeypatch) -> None:
    engine = _engine(model, monkeypatch, True, **STEP)
    try:
        fm = engine.runner.feature_memory
        assert by_shapes["memory"].step_peak == 0 and fm.step_peak > 0
        vocab = engine.runner.model_config.vocab_size
        assert fm.step_peak >= 8 * vocab * 4  # at least the logits rows, float32
        # The pool got what the measured step left of the same budget.
        assert engine.runner.num_blocks == (BUDGET - fm.total(torch.device("cpu"))) // (
            by_shapes["per_block"])
        assert len(engine.runner.kv_caches[0][0]) == engine.runner.num_blocks  # scratch gone
        assert _greedy(engine) == by_shapes["tokens"]
    finally:
        engine.close()


def test_the_measured_step_grows_with_the_largest_step(model, monkeypatch) -> None:
    peaks = {}
    for tokens in (256, 2048):  # one sequence's logits: the forward is the peak
        engine = _engine(model, monkeypatch, True, max_num_seqs=1, max_num_batched_tokens=tokens)
        peaks[tokens] = engine.runner.feature_memory.step_peak
        engine.close()
    assert peaks[2048] > 4 * peaks[256]


def test_every_tensor_parallel_rank_runs_it(model, by_shapes, monkeypatch) -> None:
    """Each rank profiles its shard (the logits' gather is a collective all of them meet)."""
    engine = _engine(model, monkeypatch, True, tensor_parallel_size=2, **STEP)
    try:
        assert engine.runner.feature_memory.step_peak > 0
        assert _greedy(engine) == by_shapes["tokens"]
    finally:
        engine.close()
