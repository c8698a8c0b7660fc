"""LoRA under CUDA graphs, checked on the CPU (the graphs themselves have not run on a GPU):
the ``stacked`` layout a captured decode step runs gives the eager layouts' result for any mix
of slots, reads the slots' weights where they are (an install between replays shows), and the
LoRA feature writes each replayed step's slots into the static buffer the capture read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.features.protocol import EAGER, StepFeatures
from services.engine.lora import step as lora_step
from services.engine.lora.feature import SECTION, LoRAFeature, LoRAWire
from services.engine.lora.layers import LoRAProjection, ModelLoRA
from services.engine.lora.step import LoRAState
from services.engine.models.layers import Linear
from services.engine.models.loader import load_model
from services.engine.parallel.group import SINGLE
from services.engine.parallel.step_broadcast import StepBatch

SLOTS, RANK, IN = 3, 8, 40


def _projection(sizes: tuple[int, ...], seed: int) -> LoRAProjection:
    linear = Linear(IN, sizes, False, torch.float32)
    linear.weight = torch.nn.Parameter(torch.empty(sum(sizes), IN), requires_grad=False)
    proj = LoRAProjection(linear, len(sizes), LoRAState(), SLOTS, RANK, torch.device("cpu"))
    for s in range(SLOTS):
        _install(proj, s, sizes, seed + s)
    return proj


def _install(proj: LoRAProjection, slot: int, sizes: tuple[int, ...], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        i: (torch.randn(RANK - i, IN, generator=gen), torch.randn(rows, RANK - i, generator=gen))
        for i, rows in enumerate(sizes)
    }
    proj.install(slot, tensors)


def _eager(
    proj: LoRAProjection, x: torch.Tensor, y: torch.Tensor, slots: np.ndarray
) -> torch.Tensor:
    """The eager layouts' result for a decode step (one token per row)."""
    proj.state.step = lora_step.build(
        slots, np.ones(len(slots), np.int64), SLOTS, torch.device("cpu")
    )
    try:
        return proj(x, y.clone())
    finally:
        proj.state.step = None


@pytest.mark.parametrize("sizes", [(48,), (32, 16, 16)], ids=["one-slice", "qkv"])
def test_stacked_layout_equals_the_eager_layouts_and_reads_slots_in_place(sizes) -> None:
    proj = _projection(sizes, seed=1)
    buffer = torch.full((16,), -1, dtype=torch.int64)  # a graph's static slots, 16 rows
    stacked = lora_step.LoRAStep(lora_step.STACKED, token_slots=buffer[:8])
    rng = np.random.default_rng(0)
    for trial in range(6):
        live = int(rng.integers(1, 9))  # rows of the step; the rest of the bucket pads
        slots = rng.integers(-1, SLOTS, live)
        if trial == 0:
            slots[:] = -1  # no adapter at all: the output as it was
        buffer[:8].fill_(-1)
        buffer[:live] = torch.from_numpy(slots)
        x, y = torch.randn(8, IN), torch.randn(8, sum(sizes))
        proj.state.step = stacked
        got = proj(x, y.clone())
        proj.state.step = None
        padded = np.concatenate([slots, np.full(8 - live, -1)])
        want = y.clone() if trial == 0 else _eager(proj, x, y, padded)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert got[live:].equal(y[live:])  # padding rows untouched
        _install(proj, int(rng.integers(0, SLOTS)), sizes, seed=100 + trial)  # between replays


@pytest.fixture(scope="module")
def feature(tiny_model_dir) -> LoRAFeature:
    model = load_model(tiny_model_dir("LlamaForCausalLM"), torch.float32)
    return LoRAFeature(ModelLoRA(model, SLOTS, RANK, torch.device("cpu")), 8, SINGLE, graphs=True)


def _decode(slots: list[int] | None) -> StepBatch:
    n = 3
    batch = StepBatch.of([5] * n, [[i] for i in range(n)], [4] * n, [1] * n, list(range(n)))
    if slots is not None:
        batch.sections[SECTION] = LoRAWire(np.array(slots, np.int64))
    return batch


def test_the_feature_keys_adapter_steps_to_its_graphs_and_fills_their_slots(feature) -> None:
    features = StepFeatures([feature])
    assert features.graph_variants() == [("lora",)]
    base, adapters = _decode(None), _decode([2, -1, 0])
    assert features.graph_key(base) == () and features.graph_key(adapters) == ("lora",)
    feature.graph_slots.fill_(7)  # whatever a previous replay left
    features.capture_forward(("lora",), 4)
    layout = feature.lora.state.step
    assert layout.kind == lora_step.STACKED
    assert layout.token_slots.data_ptr() == feature.graph_slots.data_ptr()  # the static buffer
    features.after_forward()
    assert feature.lora.state.step is None
    features.before_replay(adapters, ("lora",), 4)
    assert feature.graph_slots[:4].tolist() == [2, -1, 0, -1]  # the bucket's padding row: -1
    features.before_replay(base, (), 4)  # a base-model step replays the base graphs
    assert feature.lora.state.step is None
    feature.graphs = False  # the default on a GPU: adapter steps run eager
    try:
        assert feature.graph_key(adapters) == EAGER and features.graph_key(adapters) is None
        assert features.graph_variants() == []
    finally:
        feature.graphs = True
