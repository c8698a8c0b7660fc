"""The step-feature protocol: a feature's per-row state follows its rows through joins, leaves
and compaction; the runner calls its hooks at their points of a step, in order; one feature
can keep a step off the CUDA graphs."""

from __future__ import annotations

import random

import numpy as np
import torch

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
