"""Quantized checkpoints (issue 38): compressed-tensors W8A8 int8, written by compressed-tensors
from the tiny family models and the default model, against transformers' model running the
same quantization math in plain torch (``tests.support.quantized``): logits within ``ATOL``,
greedy tokens equal. And the seam's refusals: an unknown scheme, a scheme this device cannot
run, a ``--quantization`` that disagrees with the checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.models.layers import Linear
from services.engine.models.loader import load_model
from services.engine.quantization import quant_config_for
from services.engine.quantization.w8a8_int8 import W8A8Int8Method
from services.protocol.sampling_params import SamplingParams
from tests.engine.test_models import _kv_caches, _random_ids, _step
from tests.support.quantized import w8a8_reference, write_w8a8

PHI3 = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None, "hidden_size": 128}
FAMILIES = [
    ("llama", "LlamaForCausalLM", {}),
    ("qwen2-bias", "Qwen2ForCausalLM", {}),
    ("qwen3-qk-norm", "Qwen3ForCausalLM", {}),
    ("gemma2", "Gemma2ForCausalLM", {"sliding_window": 6, "query_pre_attn_scalar": 24}),
    ("phi3-fused", "Phi3ForCausalLM", PHI3),
    ("mixtral", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
]
# Logits of the tiny models (random weights drawn wide: logits of a few units) against the
# reference: both round the same activations to int8, but a value the two float paths put a
# hair apart can round to neighbouring steps; measured <= 2e-4 over these models and prompts.
ATOL = 2e-3
NEW_TOKENS = 24


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=FAMILIES, ids=[f[0] for f in FAMILIES])
def family(request, tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    name, architecture, overrides = request.param
    original = tiny_model_dir(architecture, **overrides)
    return original, write_w8a8(original, tmp_path_factory.mktemp(f"w8a8-{name}"))


def _engine(path: Path, **overrides) -> LLMEngine:
    config = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, **overrides}
    return LLMEngine(EngineConfig(model=str(path), **config))


def _generate(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for update in engine.step():
            out[update.request_id].extend(update.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def _reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_w8a8_layers_hold_int8(family) -> None:
    _, quantized = family
    model = load_model(quantized)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    int8 = [m for m in linears if isinstance(m.method, W8A8Int8Method)]
    assert int8 and all(m.weight.dtype == torch.int8 for m in int8)
    assert all(m.weight_scale.shape == (m.out_features, 1) for m in int8)


def test_w8a8_prefill_logits_match_the_reference(family) -> None:
    original, quantized = family
    ids = _random_ids(256, 29, seed=3)
    model = load_model(quantized)
    (logits,) = _step(model, _kv_caches(model), [ids], [0], [len(ids)], [[5, 1, 11, 2]])
    with torch.inference_mode():
        ref = w8a8_reference(original, quantized)(torch.tensor([ids])).logits[0]
    plain = load_model(original)
    (unquantized,) = _step(plain, _kv_caches(plain), [ids], [0], [len(ids)], [[5, 1, 11, 2]])
    assert (logits - ref).abs().max().item() < ATOL
    assert (unquantized - ref).abs().max().item() > 10 * ATOL  # the quantization shows


def test_w8a8_greedy_tokens_match_the_reference(family) -> None:
    original, quantized = family
    prompts = [_random_ids(256, n, seed=30 + n) for n in (13, 21)]
    reference = w8a8_reference(original, quantized)
    expected = [_reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    assert _generate(_engine(quantized), prompts, NEW_TOKENS) == expected


# --------------------------------------------------------------------------- refusals


def test_a_plain_checkpoint_with_a_quantization_flag_is_refused() -> None:
    with pytest.raises(ValueError, match="checkpoint is not quantized"):
        quant_config_for(None, "compressed-tensors", torch.device("cpu"))


def test_an_unknown_scheme_is_named_with_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported; supported: "
                                         "compressed-tensors"):
        quant_config_for({"quant_method": "bitsandbytes"}, None, torch.device("cpu"))


def _ct(weights: dict, acts: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


W8 = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False}
A8 = {"type": "int", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}


def test_an_unsupported_group_names_itself_and_what_runs_here() -> None:
    w4 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128,
          "symmetric": True, "dynamic": False}
    with pytest.raises(ValueError, match=r"group 'group_0' \(weights \{type=int, num_bits=4, "
                                         r"strategy=group, group_size=128.*supported on cpu: W8A8"):
        quant_config_for(_ct(w4, None), None, torch.device("cpu"))


def test_a_scheme_is_refused_on_a_device_it_has_never_run_on() -> None:
    with pytest.raises(ValueError, match="runs on cpu only, not cuda"):
        quant_config_for(_ct(W8, A8), None, torch.device("cuda"))


def test_the_flag_must_name_the_checkpoints_scheme(family) -> None:
    _, quantized = family
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=str(quantized), quantization="gptq-nonsense")
    config = quant_config_for(_ct(W8, A8), "compressed-tensors", torch.device("cpu"))
    assert isinstance(config.linear_method(("model.layers.0.mlp.down_proj",)), W8A8Int8Method)
    assert config.linear_method(("lm_head",)) is None
