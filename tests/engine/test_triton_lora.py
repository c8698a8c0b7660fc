"""The LoRA apply paths against an ``einsum`` reference: the CPU's batched torch path (one
adapter for the whole step, and adapters mixed with base-model tokens), and the Triton shrink
and expand kernels (compiled on a CUDA device when there is one, else under Triton's
interpreter, re-running this file in a child pytest as ``test_triton_kernels.py`` does); plus
the step layout and its trip to tensor-parallel ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from services.engine.lora import kernels
from services.engine.lora import step as lora_step
from services.engine.lora.feature import SECTION, LoRAWire
from services.engine.lora.layers import LoRAProjection
from services.engine.lora.step import LoRAState
from services.engine.models.layers import Linear
from services.engine.parallel.step_broadcast import StepBatch, decode, encode
from tests.support.triton_child import kernel_device, run_under_interpreter

_CHILD_ENV = "PAGODA_TRITON_LORA_INTERPRETER_CHILD"
INTERPRETED, DEVICE = kernel_device((kernels._shrink_kernel, kernels._expand_kernel),
                                    _CHILD_ENV)
needs_kernels = pytest.mark.skipif(
    DEVICE is None, reason="kernels compiled here and no GPU: the interpreter child runs them")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# (slot per request, new tokens per request) and the layout the batched torch path takes: a
# mixed prefill/decode step with base rows, a decode step, a long prompt beside decodes (more
# padding than rows: grouped), one adapter over the whole step.
LAYOUTS = {
    "mixed": ([1, -1, 0, 1, 2], [13, 4, 1, 1, 7], lora_step.PADDED),
    "decode": ([0, 2, -1, 2, 0, 1], [1, 1, 1, 1, 1, 1], lora_step.PADDED),
    "long-prompt": ([0, 1, -1, 2], [40, 1, 3, 1], lora_step.GROUPED),
    "one-adapter": ([2, 2, 2], [5, 1, 1], lora_step.DENSE),
}


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA: the kernel tests ran compiled")
def test_lora_kernels_under_the_interpreter() -> None:
    run_under_interpreter(__file__, _CHILD_ENV, "test_lora_kernels_under_the_interpreter")


def _projection(sizes: tuple[int, ...], in_features: int, slots: int, rank: int,
                dtype: torch.dtype, device: str) -> LoRAProjection:
    linear = Linear(in_features, sizes, False, dtype)
    linear.weight = torch.nn.Parameter(torch.empty(sum(sizes), in_features, dtype=dtype,
                                                   device=device), requires_grad=False)
    proj = LoRAProjection(linear, len(sizes), LoRAState(), slots, rank, torch.device(device))
    gen = torch.Generator().manual_seed(3)
    for s in range(slots):  # each slot its own adapter of ranks up to the max
        tensors = {}
        for i, rows in enumerate(sizes):
            r = rank - (s + i) % 3
            tensors[i] = (torch.randn(r, in_features, generator=gen).to(dtype),
                          torch.randn(rows, r, generator=gen).to(dtype))
        proj.install(s, {k: (a.to(device), b.to(device)) for k, (a, b) in tensors.items()})
    return proj


def _reference(proj: LoRAProjection, x: torch.Tensor, y: torch.Tensor,
               token_slots: np.ndarray) -> torch.Tensor:
    out = y.float().cpu().clone()
    on = torch.from_numpy(token_slots >= 0)
    idx = torch.from_numpy(token_slots[token_slots >= 0])
    h = torch.einsum("ti,tiw->tw", x[on].float().cpu(), proj.a[idx].float().cpu())
    out[on] += torch.einsum("tw,two->to", h, proj.b[idx].float().cpu())
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("sizes", [(48,), (32, 16, 16)], ids=["one-slice", "qkv"])
def test_batched_torch_path_matches_einsum(layout: str, sizes: tuple[int, ...]) -> None:
    slots, lens = (np.array(v, dtype=np.int64) for v in LAYOUTS[layout][:2])
    proj = _projection(sizes, 40, 3, 8, torch.float32, "cpu")
    tokens = int(lens.sum())
    x, y = torch.randn(tokens, 40), torch.randn(tokens, sum(sizes))
    proj.state.step = lora_step.build(slots, lens, 3, torch.device("cpu"))
    assert proj.state.step.kind == LAYOUTS[layout][2]
    want = _reference(proj, x, y, np.repeat(slots, lens))
    torch.testing.assert_close(proj(x, y.clone()), want, atol=2e-5, rtol=1e-5)
    proj.state.step = None  # a step without adapters: the output as it was
    assert proj(x, y.clone()).equal(y)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_shrink_expand_kernels_match_einsum(layout: str, dtype: torch.dtype) -> None:
    slots, lens = (np.array(v, dtype=np.int64) for v in LAYOUTS[layout][:2])
    proj = _projection((32, 16, 16), 40, 3, 8, dtype, DEVICE)
    tokens = int(lens.sum())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, 40, generator=gen).to(dtype).to(DEVICE)
    y = torch.randn(tokens, 64, generator=gen).to(dtype).to(DEVICE)
    step = lora_step.build(slots, lens, 3, torch.device(DEVICE), segments=True)
    kernels.check_lora_args(x, proj.a, proj.b, step.segments, y)
    h = torch.zeros(tokens, proj.a.shape[2], device=DEVICE)
    kernels.lora_shrink(x, proj.a, step.segments, step.max_segment, h)
    torch.testing.assert_close(h.cpu(), kernels.lora_shrink_torch(x.cpu(), proj.a.cpu(),
                                                                  step.segments.cpu()),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    proj.state.step = step
    got = proj(x, y.clone()).float().cpu()
    want = _reference(proj, x, y, np.repeat(slots, lens))
    tol = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, atol=tol, rtol=TOLERANCE[dtype])
    base = np.repeat(slots, lens) < 0  # rows of the base model are not touched
    assert got[torch.from_numpy(base)].equal(y.float().cpu()[torch.from_numpy(base)])


def test_step_layout_travels_to_the_other_ranks() -> None:
    batch = StepBatch.of([1, 2, 3, 4], [[0], [1]], [3, 1], [3, 1], [0, 1])
    plan = np.array([1, 0, 0, 8, 64, 192])  # the manifest of lora.transfer: no path crosses
    batch.sections[SECTION] = LoRAWire(np.array([1, -1]), [(1, plan, object())])
    back = decode(encode(batch)).sections[SECTION]
    assert back.slots.tolist() == [1, -1]
    [(slot, got, weights)] = back.installs
    assert (slot, got.tolist(), weights) == (1, plan.tolist(), None)
    installs_only = StepBatch.of([1, 2], [[0]], [2], [2], [0])
    installs_only.sections[SECTION] = LoRAWire(None, [(0, plan, object())])
    back = decode(encode(installs_only)).sections[SECTION]
    assert back.slots is None and [s for s, _, _ in back.installs] == [0]
    plain = StepBatch.of([1, 2], [[0]], [2], [2], [0])
    assert SECTION not in decode(encode(plain)).sections
    assert lora_step.build(np.array([-1, -1]), np.array([3, 1]), 2, torch.device("cpu")) is None
