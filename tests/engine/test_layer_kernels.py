"""Per-layer kernels are chosen once, when a model is loaded; a forward pass checks nothing.

``layer_kernels.select_kernels`` picks one implementation set per device and dtype, the loader
binds it to every layer, and the layers call it blindly. The instrumented forward passes here
fail if a layer goes back to importing a module or testing the device on every call.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.cpu_ops import ops
from services.engine.kernels import triton_available
from services.engine.models import layer_kernels
from services.engine.models.layer_kernels import select_kernels, torch_kernels
from services.engine.models.layers import RMSNorm, UsesKernels
from services.engine.models.loader import load_model
from tests.engine.test_models import _kv_caches, _random_ids, _step
from tests.support.per_call import per_layer_work

CPU = "cpu" if ops() is not None else "torch"
# Families whose layers cover every kernel-using module: norms with and without the residual,
# rotary, the dense MLP and the experts (Qwen3-MoE keeps one dense layer), Gemma's own norms.
MODELS = {
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        {"sliding_window": 6, "query_pre_attn_scalar": 24,
         "layer_types": ["sliding_attention", "full_attention"]},
    ),
}  # fmt: skip


def test_kernels_are_chosen_by_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_kernels("cpu", torch.float32).name == CPU
    assert select_kernels(torch.device("cpu"), torch.bfloat16).name == CPU
    assert select_kernels("cpu", torch.float16).name == "torch"  # the C++ kernels lack fp16
    if triton_available():  # choosing imports the kernel modules; it launches nothing
        assert select_kernels("cuda", torch.bfloat16).name == "triton"
    monkeypatch.setattr(layer_kernels, "triton_available", lambda: False)
    assert select_kernels("cuda", torch.bfloat16).name == "torch"
    monkeypatch.setattr(layer_kernels, "ops", lambda: None)  # the C++ kernels not built
    assert select_kernels("cpu", torch.float32).name == "torch"


def test_a_layer_built_alone_runs_torch_on_any_device() -> None:
    norm = RMSNorm(8, 1e-6)
    torch.nn.init.ones_(norm.weight)
    assert norm.kernels is torch_kernels(torch.float32)
    out = norm(torch.full((2, 8), 3.0))
    torch.testing.assert_close(out, torch.ones(2, 8), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_loader_binds_every_layer_once(tiny_model_dir, name: str) -> None:
    architecture, overrides = MODELS[name]
    model = load_model(tiny_model_dir(architecture, **overrides),
                       attn_backend=TorchAttentionBackend())  # fmt: skip
    bound = [m.kernels for m in model.modules() if isinstance(m, UsesKernels)]
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, UsesKernels)}
    expected = {"RMSNorm", "RotaryEmbedding", "LlamaMLP", "FusedExperts"}
    gemma = {"GemmaRMSNorm", "RotaryEmbedding", "GemmaMLP"}
    assert kinds == (gemma if name == "gemma3" else expected)
    assert len({id(k) for k in bound}) == 1 and bound[0].name == CPU


@pytest.mark.parametrize("name", list(MODELS))
def test_a_forward_pass_imports_nothing_and_tests_no_device(tiny_model_dir, name: str) -> None:
    architecture, overrides = MODELS[name]
    model = load_model(tiny_model_dir(architecture, **overrides),
                       attn_backend=TorchAttentionBackend())  # fmt: skip
    ids = _random_ids(256, 21, seed=3)
    kv = _kv_caches(model)
    _step(model, kv, [ids], [0], [12], [[5, 1, 11]])  # warm: anything lazy happens here
    with per_layer_work() as seen:
        _step(model, kv, [ids], [12], [8], [[5, 1, 11]])
        _step(model, kv, [ids], [20], [1], [[5, 1, 11]])
    assert seen == []


def test_the_recorder_sees_what_the_layers_used_to_do() -> None:
    """The check above has teeth: a layer (a stand-in module under services.engine.models)
    that tests the device and imports on every call is recorded."""
    namespace: dict = {"__name__": "services.engine.models.old_style_layer"}
    source = (
        "def norm(x):\n"
        "    if x.is_cuda:\n"
        "        return x\n"
        "    from services.engine.kernels import triton_available\n"
        "    return x\n"
    )
    exec(compile(source, "<old_style_layer>", "exec"), namespace)  # noqa: S102
    with per_layer_work() as seen:
        namespace["norm"](torch.zeros(2))
    assert seen == [
        "tensor.is_cuda in services.engine.models.old_style_layer",
        "import services.engine.kernels in services.engine.models.old_style_layer",
    ]
