"""The step-feature protocol: a feature's per-row state follows its rows through joins, leaves
and compaction; the runner calls its hooks at their points of a step, in order; one feature
can keep a step off the CUDA graphs; the engine thread's hooks (before each schedule, the
lookahead ids, whether the next step waits, after a step is applied, the counters) and the
step thread's (before the batch crosses, a feature that samples the step) reach the feature
that acts and no other; and a feature registered with ``features.registry`` is built by the
runner, its KV per token and memory counted before the pool, its hooks called in a step."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from services.engine import model_runner
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.features import registry
from services.engine.features.protocol import FeatureFactory
from services.engine.input_batch import InputBatch
from services.engine.request import Request
from services.engine.step_features import EAGER, StepFeature, StepFeatures, StepRows
from services.protocol.block_hash import BlockHasher
from services.protocol.sampling_params import SamplingParams

HASHER = BlockHasher("test-model", 4)


def _request(rid: str) -> Request:
    return Request(rid, [3, 4, 5], SamplingParams(temperature=0.0), HASHER, 16, eos_token_ids=(2,))


class RowOwner(StepFeature):
    """Keeps each row's request id, as a feature with per-row arrays does."""

    name = "rows"

    def __init__(self, max_rows: int) -> None:
        self.owner: list[str | None] = [None] * max_rows
        self.calls: list[str] = []

    def join(self, req: Request, row: int) -> None:
        assert self.owner[row] is None
        self.owner[row] = req.request_id

    def leave(self, req: Request, row: int) -> None:
        assert self.owner[row] == req.request_id
        self.owner[row] = None

    def move(self, src: int, dst: int) -> None:
        self.owner[dst], self.owner[src] = self.owner[src], None

    def prepare_rows(self, rows: StepRows) -> list[str]:
        return [self.owner[r] for r in rows.rows.tolist()]


def test_a_features_rows_follow_their_requests_through_compaction() -> None:
    feature = RowOwner(6)
    batch = InputBatch(6, 4, 64, torch.device("cpu"), features=StepFeatures([feature]))
    rng = random.Random(0)
    live: list[Request] = []
    for i in range(80):
        if live and (len(live) == 6 or rng.random() < 0.45):
            batch.remove(live.pop(rng.randrange(len(live))))
        else:
            req = _request(f"r{i}")
            batch.add(req, [i % 7])
            live.append(req)
        for req in live:
            assert feature.owner[req.batch_row] == req.request_id
        assert feature.owner[batch.num_rows :] == [None] * (6 - batch.num_rows)


class Recorder(StepFeature):
    def __init__(self, name: str, log: list[str], key: object = None) -> None:
        self.name = name
        self.log = log
        self.key = key

    def prepare_rows(self, rows: StepRows) -> str:
        self.log.append(f"{self.name}.prepare_rows")
        return f"{self.name}-state"

    def graph_key(self, batch) -> object:
        return self.key

    def before_forward(self, batch, host) -> None:
        self.log.append(f"{self.name}.before_forward({host})")

    def after_logits(self, logits, state, step) -> None:
        self.log.append(f"{self.name}.after_logits({state})")


def test_hooks_run_in_registration_order_and_one_eager_part_keeps_the_step_off_graphs() -> None:
    log: list[str] = []
    a, b = Recorder("a", log, key=("a", 1)), Recorder("b", log)
    features = StepFeatures([a, b])
    rows = StepRows(None, None, np.arange(2), [1, 1], np.arange(2))
    state = features.prepare_rows(rows)
    assert state == {"a": "a-state", "b": "b-state"}
    features.before_forward(None, {"b": "host-b"})

    class Step:
        pass

    step = Step()
    step.state = state
    features.after_logits(torch.zeros(1, 1), step)
    assert log == [
        "a.prepare_rows",
        "b.prepare_rows",
        "a.before_forward(None)",
        "b.before_forward(host-b)",
        "a.after_logits(a-state)",
        "b.after_logits(b-state)",
    ]
    assert features.graph_key(None) == (("a", 1),)
    b.key = EAGER
    assert features.graph_key(None) is None
    assert StepFeatures().graph_key(None) == ()


class Holder(StepFeature):
    """Holds lookahead ids for rows, samples the steps it has state for, counts its calls."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.held: dict[int, list[int]] = {}

    def before_schedule(self, running) -> None:
        self.log.append(f"{self.name}.before_schedule({len(running)})")

    def lookahead_ids(self, row: int, n: int) -> list[int] | None:
        return None if row not in self.held else self.held[row][:n]

    def waits_after(self, state, num_rows: int) -> bool:
        return state == "verified"

    def before_step(self, state, batch) -> None:
        self.log.append(f"{self.name}.before_step({state})")
        if state is not None:
            batch.input_ids[-1] = 99

    def sample(self, logits, state, step):
        return None if state is None else f"{self.name} sampled"

    def applied(self, sched, result) -> None:
        self.log.append(f"{self.name}.applied({result})")

    def stats(self) -> dict[str, object]:
        return {f"{self.name}_counters": len(self.log)}


def test_the_engine_and_step_thread_hooks_reach_the_feature_that_acts() -> None:
    log: list[str] = []
    a, b = Holder("a", log), Holder("b", log)
    b.held[3] = [7, 8, 9]
    features = StepFeatures([a, b])
    features.before_schedule([_request("x"), _request("y")])
    assert features.lookahead_ids(3, 2) == [7, 8]
    with pytest.raises(AssertionError):
        features.lookahead_ids(4, 1)  # lookahead tokens no feature holds

    class Batch:
        input_ids = np.zeros(3, np.int64)

    class Step:
        state = {"b": "verified"}
        batch = Batch()

    step = Step()
    assert features.waits_after(step, 5)
    assert not features.waits_after(type("Other", (), {"state": {}})(), 5)
    features.before_step(step)
    assert step.batch.input_ids.tolist() == [0, 0, 99]  # before the batch crosses
    assert features.sample(torch.zeros(1, 1), step) == "b sampled"
    assert StepFeatures([a]).sample(torch.zeros(1, 1), step) is None  # the sampler's step
    features.applied(None, "result")
    assert log == ["a.before_schedule(2)", "b.before_schedule(2)", "a.before_step(None)",
                   "b.before_step(verified)", "a.applied(result)", "b.applied(result)"]
    assert features.stats() == {"a_counters": 6, "b_counters": 6}


class Probe(StepFeature):
    name = "probe"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, hook: str) -> None:
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def before_schedule(self, running) -> None:
        self._count("before_schedule")

    def before_step(self, state, batch) -> None:
        self._count("before_step")

    def applied(self, sched, result) -> None:
        self._count("applied")


class ProbeFactory(FeatureFactory):
    name = Probe.name
    KV_PER_TOKEN = 4096
    ITEM = 3 * 1024**2

    def __init__(self, runner) -> None:
        self.rank = runner.tp.rank

    def kv_bytes_per_token(self) -> int:
        return self.KV_PER_TOKEN

    def held_bytes(self) -> dict[str, int]:
        return {"probe buffers": self.ITEM}

    def build(self, runner) -> Probe:
        return Probe()


def test_a_registered_feature_is_built_counted_and_called_without_the_runner_naming_it(
        tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    budget = 16 * 1024**2
    monkeypatch.setattr(model_runner, "_DEFAULT_CPU_KV_BYTES", budget)
    monkeypatch.setenv(model_runner.SKIP_WARM_UP_ENV, "1")
    assert "speculation" in registry.makers()  # the providers' modules registered theirs
    monkeypatch.setattr(registry, "_makers", {Probe.name: ProbeFactory})
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("LlamaForCausalLM")),
                                    max_num_seqs=4, max_num_batched_tokens=32))
    try:
        runner = engine.runner
        probe = runner.features.get(Probe.name)
        assert isinstance(probe, Probe)
        held = runner.feature_memory
        assert held.item("probe buffers") == ProbeFactory.ITEM
        caches = runner.kv_caches
        per_block = caches[0][0].nbytes * 2 * len(caches) // runner.num_blocks
        per_block += ProbeFactory.KV_PER_TOKEN * runner.block_size
        assert runner.num_blocks == (budget - held.total(torch.device("cpu"))) // per_block
        req = engine.add_request("p", [1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True,
                                                                   temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        assert len(req.output_token_ids) == 3
        assert probe.calls == {"before_schedule": 3, "before_step": 3, "applied": 3}
    finally:
        engine.close()
