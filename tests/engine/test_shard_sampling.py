"""Sampling on vocabulary shards (``shard_sampling``) gives the whole row's tokens.

The logits of a batch are cut into N shards as the LM head splits its vocabulary (uneven
shards too); each shard's candidates, merged, must give exactly the tokens the sampler draws
from the whole rows with the same generators: greedy, Gumbel-max (seeded and not), top-k with
ties at the cut, mixed batches, a dead row. Rows that need the whole distribution get no plan.
The engine over 2 and 3 ranks is in ``test_tensor_parallel.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine import shard_sampling
from services.engine.cpu_ops import ops
from services.engine.models.partition import vocab_shard
from services.engine.sampler import Sampler, make_generator
from services.engine.sampling_batch import SamplingBatch, SamplingRequest
from services.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(ops() is None, reason="the CPU kernels did not build here")


def _rows(params: list[SamplingParams], seed: int) -> list[SamplingRequest]:
    return [SamplingRequest(p, [1, 2], [3], None if p.seed is None else make_generator(p.seed))
            for p in params]


def _on_shards(logits: torch.Tensor, params: list[SamplingParams], ranks: int) -> list[int]:
    """What the ranks compute, one shard after another, and rank 0's merge."""
    vocab = logits.shape[1]
    batch = SamplingBatch.from_requests(_rows(params, 0), vocab)
    plan = shard_sampling.plan(batch, torch.device("cpu"))
    assert plan is not None
    plan = shard_sampling.ShardPlan.decode(plan.encode())  # as the workers receive it
    parts = []
    for rank in range(ranks):
        _, start, real = vocab_shard(vocab, rank, ranks)
        shard = logits[:, start : start + real].contiguous()
        parts.append(shard_sampling.shard_candidates(shard, plan, start))
    return shard_sampling.merge(torch.cat(parts, 1), plan).tolist()


def _whole(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    batch = SamplingBatch.from_requests(_rows(params, 0), logits.shape[1])
    return Sampler()(logits, batch).token_ids


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.7, top_k=5, seed=12),
    SamplingParams(temperature=1.3, top_k=40, seed=13),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=2.0, seed=14),
    SamplingParams(temperature=1.0, top_k=1, seed=15),
]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("vocab", [49_152, 20_001, 255])
def test_shards_give_the_whole_rows_tokens(ranks: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab + ranks)
    for trial in range(4):
        logits = torch.randn(len(MIXED), vocab, generator=gen) * (1 + trial)
        if trial == 3:  # integer logits: ties everywhere, at the top-k cut too
            logits = logits.round()
        assert _on_shards(logits, MIXED, ranks) == _whole(logits, MIXED), (vocab, trial)


def test_all_greedy_and_a_dead_row() -> None:
    params = [SamplingParams(temperature=0.0)] * 3
    logits = torch.randn(3, 1000)
    logits[1, 10] = logits[1, 900] = 99.0  # a tie across shards: the lower id
    assert _on_shards(logits, params, 2) == _whole(logits, params)
    assert _on_shards(logits, params, 2)[1] == 10
    dead = torch.full((1, 64), float("-inf"))
    sampling = [SamplingParams(temperature=1.0, seed=3)]
    assert _on_shards(dead, sampling, 2) == _whole(dead, sampling) == [0]


def test_seeded_rows_repeat_and_unseeded_rows_spread() -> None:
    logits = torch.zeros(64, 3000)  # uniform: the noise alone picks
    seeded = [SamplingParams(temperature=1.0, seed=5)] * 64
    assert len(set(_on_shards(logits, seeded, 3))) == 1  # one seed, one stream: one token
    free = [SamplingParams(temperature=1.0)] * 64
    assert len(set(_on_shards(logits, free, 3))) > 50


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, logprobs=2),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=shard_sampling.MAX_TOP_K + 1),
    SamplingParams(temperature=0.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, min_tokens=4),
], ids=["logprobs", "top_p", "min_p", "large_top_k", "penalty", "min_tokens"])
def test_rows_that_need_the_whole_distribution_are_gathered(params: SamplingParams) -> None:
    rows = [SamplingRequest(SamplingParams(temperature=0.0), [1], [])]
    rows.append(SamplingRequest(params, [1], [], eos_token_ids=[2]))
    batch = SamplingBatch.from_requests(rows, 100)
    assert shard_sampling.plan(batch, torch.device("cpu")) is None


def test_the_gather_moves_a_few_numbers_per_row() -> None:
    batch = SamplingBatch.from_requests(_rows(MIXED, 0), 49_152)
    plan = shard_sampling.plan(batch, torch.device("cpu"))
    shard = shard_sampling.shard_candidates(torch.randn(len(MIXED), 24_576), plan, 0)
    assert shard.shape == (len(MIXED), 40, 3)  # the largest top-k: 40 candidates a row
    assert shard.nbytes < 24_576 * 4 * len(MIXED) / 20
    assert np.array_equal(shard_sampling.ShardPlan.decode(plan.encode()).keys, plan.keys)
