"""The GPU runner's host side on the CPU: one-copy staging, padding, buffer reuse, buckets, and
the engine's tokens through the staged (and graph-layout) path equal the plain path's."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.attention.metadata import build_attention_metadata, pack_tables
from services.engine.cuda_graphs import bucket_for, capture_sizes
from services.engine.kernels import interpreter_enabled, triton_available
from services.engine.step_buffers import StepBuffers

BLOCK = 16


def _random_step(rng: random.Random, num_seqs: int, decode: bool):
    tables, seq_lens, query_lens, next_block = [], [], [], 0
    for _ in range(num_seqs):
        k = rng.randint(1, 200)
        q = 1 if decode else rng.randint(1, k)
        n_blocks = -(-k // BLOCK) + rng.randint(0, 2)  # tables may run longer than needed
        tables.append(list(range(next_block, next_block + n_blocks))[::-1])
        next_block += n_blocks
        seq_lens.append(k)
        query_lens.append(q)
    ids = [rng.randrange(1000) for _ in range(sum(query_lens))]
    return ids, tables, seq_lens, query_lens


def _stage(buffers: StepBuffers, ids, tables, seq_lens, q_lens, rows, pad_to=None):
    packed, num_blocks = pack_tables(tables)
    return buffers.stage(np.asarray(ids), packed, num_blocks, np.asarray(seq_lens),
                         np.asarray(q_lens), np.asarray(rows), pad_to=pad_to)


def _buffers() -> StepBuffers:
    return StepBuffers(max_num_tokens=2048, max_num_seqs=16, max_blocks_per_seq=20,
                       block_size=BLOCK, device=torch.device("cpu"))


@pytest.mark.parametrize("decode", [False, True])
def test_staged_step_equals_the_metadata_built_tensor_by_tensor(decode: bool) -> None:
    buffers, rng = _buffers(), random.Random(decode)
    for _ in range(5):  # several steps through the same (alternating) buffers
        ids, tables, seq_lens, q_lens = _random_step(rng, rng.randint(1, 16), decode)
        rows = sorted(rng.sample(range(len(seq_lens)), rng.randint(1, len(seq_lens))))
        ends = np.cumsum(q_lens) - 1
        pad = bucket_for(capture_sizes(16), len(seq_lens)) if decode else None
        staged = _stage(buffers, ids, tables, seq_lens, q_lens, ends[rows], pad_to=pad)
        want, positions = build_attention_metadata(tables, seq_lens, q_lens, BLOCK)
        got = staged.meta
        assert staged.input_ids.tolist() == ids
        assert torch.equal(staged.positions, positions)
        assert staged.logits_rows.tolist() == ends[rows].tolist()
        for name in ("slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens",
                     "block_tables"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert (got.max_seqlen_q, got.max_seqlen_k) == (want.max_seqlen_q, want.max_seqlen_k)
        assert (got.query_lens, got.seq_lens) == (want.query_lens, want.seq_lens)
        if decode:  # what a graph reads: the fixed-stride table holds the step's rows
            width = want.block_tables.shape[1]
            assert torch.equal(buffers.graph_tables[: len(seq_lens), :width], want.block_tables)


def test_padding_rows_write_no_kv_and_read_one_key() -> None:
    buffers = _buffers()
    ids, tables, seq_lens, q_lens = _random_step(random.Random(3), 5, decode=True)
    _stage(buffers, ids, tables, seq_lens, q_lens, list(range(5)), pad_to=8)
    graph = buffers.graph_inputs(8, decode_num_splits=2)
    meta = graph.meta
    assert graph.input_ids.tolist() == ids + [0, 0, 0]
    assert meta.slot_mapping[5:].tolist() == [-1, -1, -1]
    assert meta.context_lens.tolist() == seq_lens + [1, 1, 1]
    assert meta.cu_seqlens_q.tolist() == list(range(9))
    assert meta.cu_seqlens_k.tolist()[5:] == [sum(seq_lens) + i for i in range(4)]
    assert meta.block_tables.stride(0) == buffers.max_blocks_per_seq  # the captured stride
    assert meta.decode_num_splits == 2


def test_graph_inputs_sit_at_fixed_addresses_whatever_the_step() -> None:
    buffers, rng = _buffers(), random.Random(1)
    before = buffers.graph_inputs(8, 1)
    pointers = [t.data_ptr() for t in (before.input_ids, before.positions,
                                       before.meta.slot_mapping, before.meta.context_lens,
                                       before.meta.block_tables)]
    for decode in (False, True, False, True):  # eager layouts in between reuse the bytes
        ids, tables, seq_lens, q_lens = _random_step(rng, rng.randint(1, 8), decode)
        pad = 8 if decode else None
        _stage(buffers, ids, tables, seq_lens, q_lens, [0], pad_to=pad)
    after = buffers.graph_inputs(8, 1)
    assert pointers == [t.data_ptr() for t in (after.input_ids, after.positions,
                                               after.meta.slot_mapping, after.meta.context_lens,
                                               after.meta.block_tables)]
    assert after.input_ids[: len(ids)].tolist() == ids  # the last (decode) step is there


def test_capture_sizes_and_buckets() -> None:
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in itertools.pairwise(sizes[3:]))
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert [bucket_for(sizes, n) for n in (1, 3, 5, 9, 250, 256)] == [1, 4, 8, 16, 256, 256]
    assert bucket_for(sizes, 257) is None


class _EagerReplay:
    """Runs what a decode graph would replay (the forward over ``graph_inputs``), eagerly:
    the graph-layout plumbing checked on a machine without CUDA."""

    def __init__(self, runner, sizes: list[int]) -> None:
        self.sizes, self.runner, self.replays = sizes, runner, 0

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_for(self.sizes, num_seqs)

    def replay(self, size: int) -> torch.Tensor:
        self.replays += 1
        g = self.runner.buffers.graph_inputs(size, decode_num_splits=3)
        return self.runner.model(g.input_ids, g.positions, self.runner.kv_caches, g.meta)


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_tokens_through_the_staged_path_equal_the_plain_path(
    fast_model_dir, graphs: bool
) -> None:
    """Greedy tokens of a mixed batch (prefill chunks, decodes, 5 requests so decode pads to
    the bucket of 8) are the same whether a step's inputs are built per step or staged."""
    if graphs and not (triton_available() and interpreter_enabled()):
        pytest.skip("the graph layout is read by the Triton kernels (interpreter off here)")
    backend = "triton" if graphs else "torch"
    kwargs = {"device": "cpu", "attention_backend": backend, "max_num_batched_tokens": 64,
                  "max_num_seqs": 8, "num_blocks": 64}
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randint(5, 90))] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(fast_model_dir), **kwargs)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    staged = LLM(str(fast_model_dir), **kwargs)
    runner = staged.engine.runner
    runner.buffers = StepBuffers(64, 8, 16, runner.block_size, torch.device("cpu"))
    if graphs:
        runner.graphs = _EagerReplay(runner, capture_sizes(8))
    got = [o.outputs[0].token_ids for o in staged.generate(prompts, params, use_tqdm=False)]
    assert got == want
    if graphs:
        assert runner.graphs.replays >= 5
