"""The common step (every request decodes one token) is scheduled, prepared and applied by
list operations (``Scheduler._schedule_decodes``, ``ModelRunner._prepare_decodes``,
``Scheduler._apply_decodes``), and while the running set stays the same, from the arrays of a
``DecodeBatch`` (``Scheduler._schedule_batch``; its apply is ``_apply_decodes``'). They must
give what the per-request loops give, token for token and block for block, and a decode step
must really take them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from services.engine.llm import LLM
from services.engine.model_runner import ModelRunner
from services.engine.scheduler import Scheduler
from services.protocol.sampling_params import SamplingParams
from services.protocol.structured_outputs import StructuredOutputsParams

# Blocks of 4 (a block fills every fourth step: hashing and caching inside decode steps), a
# pool too small for all (preemption), a budget that chunks the longer prompts.
# A context of 64 tokens, which the first request reaches before its max_tokens.
ENGINE = {"max_num_batched_tokens": 48, "max_num_seqs": 8, "num_blocks": 48, "block_size": 4,
          "max_model_len": 64}
ARRAY_PATHS = ((Scheduler, "_schedule_decodes"), (ModelRunner, "_prepare_decodes"),
               (Scheduler, "_apply_decodes"), (Scheduler, "_schedule_batch"))


@contextmanager
def _loops_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as m:
        for cls, name in ARRAY_PATHS:
            m.setattr(cls, name, lambda *args, **kwargs: None)
        yield


@contextmanager
def _counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[int]]]:
    """Counts each array path's calls: [taken, declined]."""
    counts = {name: [0, 0] for _, name in ARRAY_PATHS}
    with monkeypatch.context() as m:
        for cls, name in ARRAY_PATHS:
            m.setattr(cls, name, _counting(getattr(cls, name), counts[name]))
        yield counts


def _counting(fn, count: list[int]):
    def wrapped(*args, **kwargs):
        got = fn(*args, **kwargs)
        count[got is None] += 1
        return got
    return wrapped


def _prompts() -> list[list[int]]:
    shared = [(5 * j) % 700 + 40 for j in range(12)]  # three blocks every third prompt shares
    out = []
    for i in range(10):
        body = [(37 * i + 13 * j) % 900 + 25 for j in range(1 + (i * 29) % 40)]
        out.append(shared + body if i % 3 == 0 else body)
    return out


def _params(stop_tok: int) -> list[SamplingParams]:
    """Greedy, seeded, stop tokens mid-output, min_tokens, max_tokens on and off a block
    boundary, logprobs, a grammar, and penalties (whose rows take the loops)."""
    regex = StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{1,3}")
    return [
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),  # 13 + 60 > 64
        SamplingParams(max_tokens=21, temperature=0.0, stop_token_ids=[stop_tok], logprobs=2),
        SamplingParams(max_tokens=17, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, seed=4, n=2),
        SamplingParams(max_tokens=14, temperature=0.0, min_tokens=8,
                       stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=regex),
        SamplingParams(max_tokens=16, temperature=0.0, stop=["e"], ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0.7, seed=9, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=11, temperature=0.0, repetition_penalty=1.2,
                       ignore_eos=True),
    ]


def _run(model: Path, async_scheduling: bool, params: list[SamplingParams]) -> tuple:
    llm = LLM(str(model), async_scheduling=async_scheduling, **ENGINE)
    try:
        engine = llm.engine
        outs, cached = [], []
        for _ in range(2):  # the second run hits the first's prefixes
            outs.append(llm.generate(_prompts(), params, use_tqdm=False))
            cached.append({h for e in engine.block_manager.snapshot_events()
                           for h in e.block_hashes})
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
        got = [[(o.num_cached_tokens, [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                        None if c.logprobs is None else
                                        [sorted(d) for d in c.logprobs])
                                       for c in o.outputs]) for o in run] for run in outs]
        return got, engine.scheduler.num_preemptions, cached
    finally:
        llm.engine.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_array_paths_give_what_the_loops_give(fast_model_dir: Path, async_scheduling: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(str(fast_model_dir), **ENGINE) as llm:
        stop_tok = llm.generate(_prompts()[1], greedy, use_tqdm=False)[0].outputs[0].token_ids[2]
    params = _params(stop_tok)
    with _counted(monkeypatch) as counts:
        fast = _run(fast_model_dir, async_scheduling, params)
    with _loops_only(monkeypatch):
        loops = _run(fast_model_dir, async_scheduling, params)
    assert fast == loops
    assert fast[1] > 0  # the pool was too small: requests were preempted
    reasons = {c[2] for run in fast[0] for _, samples in run for c in samples}
    assert reasons == {"length", "stop"}
    assert len(fast[0][0][0][1][0][0]) == 64 - 13  # the context ended it
    # The array paths ran (and declined where the step was not theirs); with async
    # scheduling no step is scheduled from a batch (a step is in flight at every schedule).
    batch = counts.pop("_schedule_batch")
    for name, (taken, declined) in counts.items():
        assert taken > 0 and declined > 0, (name, counts)
    assert (batch[0] > 0) != async_scheduling, batch


def test_a_step_of_decodes_takes_the_array_paths(fast_model_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[11 + i, 12, 13, 14, 15] for i in range(8)]
    with LLM(str(fast_model_dir), max_num_seqs=8, block_size=16) as llm:
        with _counted(monkeypatch) as counts:
            outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    # One prefill step, then 39 decode steps: every one of those through the array paths,
    # those after the first from the batch the first one's apply built.
    assert counts["_schedule_batch"] == [38, 0]
    assert counts["_schedule_decodes"] == [1, 1]
    assert counts["_prepare_decodes"] == [39, 1]
    assert counts["_apply_decodes"] == [39, 1]


def test_the_engine_keeps_decode_batches_only_without_a_kv_connector(
        fast_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connector moves KV beside the steps: no batch is kept across them (the engine decides
    it once, the scheduler only reads it), and the array paths still give every token."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[11 + i, 12, 13, 14, 15] for i in range(4)]
    with LLM(str(fast_model_dir), max_num_seqs=8, block_size=16) as plain:
        assert plain.engine.scheduler.decode_batches
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(str(fast_model_dir), max_num_seqs=8, block_size=16,
             kv_offloading_size=0.01) as tiered:
        assert tiered.engine.kv_connector is not None
        assert not tiered.engine.scheduler.decode_batches
        with _counted(monkeypatch) as counts:
            outs = tiered.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert counts["_schedule_batch"] == [0, 0] and counts["_apply_decodes"][0] == 11
