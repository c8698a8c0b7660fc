"""The model families beyond Llama (issue 15) against transformers, on tiny random models.

Mistral and Mixtral (sliding window), Qwen2-MoE and Qwen3-MoE (experts, Qwen2-MoE's shared
expert), Gemma 2 and Gemma 3 (soft-caps, interleaved windows, Gemma 3's local RoPE base) and
Phi-3 (fused checkpoint projections, longrope): each one's prefill and paged-decode logits
equal transformers' in float32, its greedy output equals ``generate``, and the engine gives the
same tokens alone, batched, without the prefix cache and in a pool small enough to preempt.
Windows are a few tokens wide so every prompt is longer than them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.models import experts as experts_module
from services.engine.models import moe
from services.engine.models.config import ModelConfig
from services.engine.models.layer_kernels import silu_and_mul_torch, torch_kernels
from services.engine.models.loader import load_model
from services.protocol.sampling_params import SamplingParams
from tests.engine.test_models import (
    ATOL,
    _check_chunked_then_decode,
    _check_two_sequences,
    _hf_logits,
    _hf_model,
    _kv_caches,
    _our_model,
    _random_ids,
    _step,
)

# Phi-3's longrope factors (long ones for sequences past original_max_position_embeddings).
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(16)],
    "long_factor": [1.5 + 0.3 * i for i in range(16)],
}
# Token ids inside the tiny vocabulary; no eos, which `generate` would treat apart.
PHI3 = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None, "hidden_size": 128}

# (id, architecture, config overrides) of the tiny random models.
FAMILIES = [
    ("mistral-window", "MistralForCausalLM", {"sliding_window": 7}),
    (
        "mixtral-window",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 9},
    ),
    (
        "qwen3-moe",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    (
        "qwen2-moe-shared",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
    (
        "gemma2",
        "Gemma2ForCausalLM",
        # Caps low enough to bite on these logits (the defaults, 50 and 30, rarely would).
        {
            "sliding_window": 6,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 1.5,
            "final_logit_softcapping": 3.0,
        },
    ),
    (
        "gemma3",
        "Gemma3ForCausalLM",
        {
            "sliding_window": 6,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    (
        "phi3-longrope",
        "Phi3ForCausalLM",
        {
            **PHI3,
            "rope_parameters": LONGROPE,
            "max_position_embeddings": 128,
            # Every prompt here is longer: the long factors from the first token, as
            # transformers (the short ones are tested further down).
            "original_max_position_embeddings": 8,
        },
    ),
]
IDS = [f[0] for f in FAMILIES]


@pytest.fixture(scope="module", params=FAMILIES, ids=IDS)
def family(request: pytest.FixtureRequest, tiny_model_dir) -> tuple[str, Path]:
    name, architecture, overrides = request.param
    return name, tiny_model_dir(architecture, **overrides)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------- logits


def test_prefill_matches_transformers(family: tuple[str, Path]) -> None:
    _, path = family
    ids = _random_ids(256, 37, seed=1)
    model = _our_model(str(path))
    (logits,) = _step(model, _kv_caches(model), [ids], [0], [len(ids)], [[5, 1, 11]])
    ref = _hf_logits(path, ids)
    assert ref.abs().max() > 1.0
    assert (logits - ref).abs().max().item() < ATOL


def test_chunked_prefill_then_paged_decode_match_transformers(family: tuple[str, Path]) -> None:
    _, path = family
    ids = _random_ids(256, 40, seed=2)
    assert _check_chunked_then_decode(path, ids, chunks=(13, 12)) < ATOL


def test_two_sequences_in_one_batch_match_transformers(family: tuple[str, Path]) -> None:
    _, path = family
    a, b = _random_ids(256, 21, seed=3), _random_ids(256, 34, seed=4)
    assert _check_two_sequences(path, a, b) < ATOL


def test_family_features_are_switched_on(family: tuple[str, Path]) -> None:
    """The tiny configs exercise what they are meant to (a parity test of a model whose window
    or caps were silently dropped would pass against a transformers that ignores them too)."""
    name, path = family
    cfg = ModelConfig.from_hf_dir(path)
    expected_windows = {
        "mistral-window": (7, 7),
        "mixtral-window": (9, 9),
        "gemma2": (6, None),
        "gemma3": (6, None),
    }
    assert cfg.layer_windows == expected_windows.get(name, ())
    assert cfg.max_position_embeddings > 40  # no longer capped at the window
    if name == "gemma2":
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (1.5, 3.0)
    if name == "gemma3":
        assert cfg.local_rope is not None and cfg.local_rope.theta != cfg.rope.theta
    if name.startswith(("mixtral", "qwen")):
        assert cfg.moe is not None
    if name == "phi3-longrope":
        assert cfg.rope.rope_type == "longrope" and cfg.rope.attention_factor > 1.0


# --------------------------------------------------------------------------- engine


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


PROMPTS = [_random_ids(256, n, seed=10 + n) for n in (17, 23, 9, 30)]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def batched(family: tuple[str, Path]) -> list[list[int]]:
    """The engine's greedy tokens for PROMPTS, all in one batch (the reference of this module)."""
    return _generate(_engine(family[1]), PROMPTS, NEW_TOKENS)


def test_greedy_matches_transformers_generate(family, batched) -> None:
    _, path = family
    hf = _hf_model(str(path))
    for prompt, ours in zip(PROMPTS[:2], batched[:2], strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            # No eos: the engine ignores it too (min_new_tokens would suppress the eos logit).
            ref = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        assert ours == ref[0, len(prompt) :].tolist()


def test_greedy_identical_alone_without_prefix_cache_and_preempted(family, batched) -> None:
    _, path = family
    alone = _engine(path)
    assert [_generate(alone, [p], NEW_TOKENS)[0] for p in PROMPTS[:2]] == batched[:2]
    # Again on the same engine: the prompts now hit the prefix cache.
    assert _generate(alone, PROMPTS, NEW_TOKENS) == batched
    assert alone.stats().prefix_cache_hits > 0
    no_cache = _engine(path, enable_prefix_caching=False)
    assert _generate(no_cache, PROMPTS, NEW_TOKENS) == batched
    # 24 blocks of 4 tokens hold one or two of these requests at a time: the others wait or
    # are preempted and recomputed.
    tiny = _engine(path, num_blocks=24)
    assert _generate(tiny, PROMPTS, NEW_TOKENS) == batched
    assert tiny.stats().num_preemptions > 0


# --------------------------------------------------------------------------- longrope


def test_phi3_limited_to_the_pretraining_context_uses_the_short_factors(tiny_model_dir) -> None:
    """With --max-model-len at original_max_position_embeddings (64) every sequence rotates with
    the short factors, as transformers for sequences that short; the engine's default (the
    model's 128 positions) uses the long ones for every token (see ``models.phi3``)."""
    path = tiny_model_dir(
        "Phi3ForCausalLM",
        **PHI3,
        rope_parameters=LONGROPE,
        max_position_embeddings=128,
        original_max_position_embeddings=64,
    )
    ids = _random_ids(256, 37, seed=1)
    ref = _hf_logits(path, ids)
    model = load_model(path, attn_backend=TorchAttentionBackend())
    (long,) = _step(model, _kv_caches(model), [ids], [0], [len(ids)], [[5, 1, 11]])
    assert (long - ref).abs().max().item() > 0.1  # the factors matter here
    model.limit_context(64)
    (short,) = _step(model, _kv_caches(model), [ids], [0], [len(ids)], [[5, 1, 11]])
    assert (short - ref).abs().max().item() < ATOL
    prompt = _random_ids(256, 20, seed=7)
    with torch.inference_mode():
        expected = _hf_model(str(path)).generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None
        )
    engine = _engine(path, max_model_len=64)
    assert _generate(engine, [prompt], 40) == [expected[0, len(prompt) :].tolist()]


# --------------------------------------------------------------------------- experts


def _naive_experts(x, gate_up, down, weights, experts) -> torch.Tensor:
    """Token by token, choice by choice, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            g, u = (x[t].double() @ gate_up[e].double().T).chunk(2)
            out[t] += w * (torch.nn.functional.silu(g) * u) @ down[e].double().T
    return out


ASSIGNMENTS = [
    # Every expert gets tokens (and some token pairs share both experts).
    [[0, 1], [2, 3], [4, 5], [5, 4], [1, 0], [3, 2], [0, 5]],
    # Experts 1, 3 and 4 get no token; expert 2 gets every token.
    [[2, 0], [2, 5], [0, 2], [2, 0], [5, 2], [2, 0], [0, 2]],
    # A single token (a decode step): four of six experts idle.
    [[3, 1]],
]
ASSIGNMENT_IDS = ["all-experts", "idle-experts", "one-token"]
# The host path (CPU) and the device path (GPU), its grouped matmul by the torch reference.
EXPERT_PATHS = {
    "host": partial(experts_module.grouped_experts, act=silu_and_mul_torch),
    "device": partial(
        experts_module.routed_experts, gemm=experts_module.grouped_gemm_torch,
        act=silu_and_mul_torch,
    ),
}


@pytest.mark.parametrize("path", list(EXPERT_PATHS))
@pytest.mark.parametrize("assignment", ASSIGNMENTS, ids=ASSIGNMENT_IDS)
def test_experts_match_a_per_token_loop(assignment: list[list[int]], path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = 6, 16, 8
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.3
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.3
    experts = torch.tensor(assignment)
    x = torch.randn(len(assignment), hidden, generator=gen)
    weights = torch.rand(experts.shape, generator=gen)
    out = EXPERT_PATHS[path](x, gate_up, down, weights, experts)
    expected = _naive_experts(x, gate_up, down, weights, experts).float()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mixtral-window", "qwen3-moe", "qwen2-moe-shared"])
def test_moe_routed_on_the_device_matches_transformers(tiny_model_dir, name: str) -> None:
    """The GPU's expert path (device routing; the grouped matmul by its torch reference here)
    in a whole model: a prefill chunk that reaches every expert, a second chunk, then decodes
    that leave most experts idle, each step's logits as transformers'."""
    _, architecture, overrides = FAMILIES[IDS.index(name)]
    path = tiny_model_dir(architecture, **overrides)
    model = load_model(path, attn_backend=TorchAttentionBackend())
    model.use_kernels(replace(torch_kernels(torch.float32), experts=EXPERT_PATHS["device"]))
    ids = _random_ids(256, 31, seed=5)
    ref = _hf_logits(path, ids)
    kv, done = _kv_caches(model), 0
    for n in (17, 10, 1, 1, 1, 1):
        (logits,) = _step(model, kv, [ids], [done], [n], [[5, 1, 11]])
        assert (logits - ref[done : done + n]).abs().max().item() < ATOL
        done += n


def test_tiny_moe_prefill_reaches_every_expert_and_decode_leaves_experts_idle(
    tiny_model_dir,
) -> None:
    """The parity tests above cover both regimes: the 37-token prefill routes tokens to all
    eight experts of Qwen3-MoE, a decode step (one token, top 2) leaves six idle."""
    _, architecture, overrides = FAMILIES[IDS.index("qwen3-moe")]
    path = tiny_model_dir(architecture, **overrides)
    model = load_model(path, attn_backend=TorchAttentionBackend())
    used: list[set[int]] = []
    bound = next(m for m in model.modules() if isinstance(m, moe.FusedExperts)).kernels

    def spy(x, gate_up, down, weights, experts):
        used.append(set(experts.reshape(-1).tolist()))
        return bound.experts(x, gate_up, down, weights, experts)

    model.use_kernels(replace(bound, experts=spy))
    ids = _random_ids(256, 38, seed=1)
    kv = _kv_caches(model)
    _step(model, kv, [ids], [0], [37], [[5, 1, 11]])
    assert used[0] == set(range(8))
    used.clear()
    _step(model, kv, [ids], [37], [1], [[5, 1, 11]])
    assert len(used[0]) == 2


# --------------------------------------------------------------------------- Gemma norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_rounds_like_transformers(dtype: torch.dtype) -> None:
    """(1 + weight) in float32 and one rounding at the end, also in bf16."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from services.engine.models.gemma import GemmaRMSNorm

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, generator=gen) * 0.3).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    hf = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    hf.weight.data.copy_(weight)
    ours = GemmaRMSNorm(64, 1e-6, dtype)
    ours.weight.data.copy_(weight)
    with torch.no_grad():
        ours.weight_f32.copy_(weight.float() + 1.0)
        ours.weight.copy_(ours.weight_f32)
        expected = hf(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-6, rtol=0)
        residual, delta = x.clone(), torch.randn(5, 64, generator=gen).to(dtype)
        out, summed = ours(delta, residual)
        assert torch.equal(summed, x + delta)
        torch.testing.assert_close(out, hf(x + delta), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- config.json forms


def _raw(architecture: str, **fields) -> dict:
    return {
        "architectures": [architecture],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        **fields,
    }


def test_hub_style_configs_parse() -> None:
    """The forms the published checkpoints' config.json files use (before transformers 5)."""
    gemma3 = ModelConfig.from_hf_dict(_raw(
        "Gemma3ForCausalLM", hidden_activation="gelu_pytorch_tanh", sliding_window=512,
        sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=256,
    ))  # fmt: skip
    assert gemma3.layer_windows == (512,) * 5 + (None,)
    assert (gemma3.rope.rope_type, gemma3.rope.factor, gemma3.rope.theta) == ("linear", 8.0, 1e6)
    assert gemma3.local_rope is not None and gemma3.local_rope.theta == 1e4
    assert gemma3.attn_scale == 256**-0.5
    phi3 = ModelConfig.from_hf_dict(_raw(
        "Phi3ForCausalLM", max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
        sliding_window=262144,
    ))  # fmt: skip
    assert phi3.rope.rope_type == "longrope" and phi3.rope.original_max_position_embeddings == 4096
    assert abs(phi3.rope.attention_factor - (1 + math.log(32) / math.log(4096)) ** 0.5) < 1e-12
    qwen3_moe = ModelConfig.from_hf_dict(_raw(
        "Qwen3MoeForCausalLM", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[5],
    ))  # fmt: skip
    moe_cfg = qwen3_moe.moe
    assert (moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.intermediate_size) == (128, 8, 32)
    assert moe_cfg.sparse_layers == (False, True, False, True, False, False)
    assert moe_cfg.normalize_top_k and not moe_cfg.float32_weights
    mixtral = ModelConfig.from_hf_dict(_raw(
        "MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
    ))  # fmt: skip
    assert mixtral.moe.intermediate_size == 128 and mixtral.moe.float32_weights
    assert mixtral.layer_windows == ()


@pytest.mark.parametrize(
    ("architecture", "fields", "message"),
    [
        ("MixtralForCausalLM", {}, "experts"),
        ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts"),
        ("Gemma2ForCausalLM", {"hidden_activation": "gelu"}, "hidden_act"),
        ("Phi3ForCausalLM", {"rope_scaling": {"type": "longrope"}}, "longrope"),
    ],
)
def test_family_configs_that_cannot_run_are_rejected(architecture, fields, message) -> None:
    raw = _raw(architecture, original_max_position_embeddings=64, **fields)
    with pytest.raises(ValueError, match=message):
        config = ModelConfig.from_hf_dict(raw)
        with torch.device("meta"):  # building is where a missing expert count shows
            moe.MixtralForCausalLM(config, TorchAttentionBackend())
