"""Our Llama/Qwen2/Qwen3 implementations against HF transformers, through the paged KV cache.

Every parity check runs the model the way the engine does: one flattened batch per step, K/V
written to and read from a block-paged cache whose block ids are deliberately out of order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common import default_model
from services.engine.attention.metadata import build_attention_metadata
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.models import default as default_module
from services.engine.models.config import ModelConfig, RopeConfig, parse_rope
from services.engine.models.layers import CausalLM, rope_inv_freq
from services.engine.models.loader import load_model
from services.engine.models.registry import (
    MODEL_TYPES,
    supported_architectures,
    supported_model_types,
)

ATOL = 1e-4
BLOCK_SIZE = 16
NUM_BLOCKS = 12

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that tiny head_dim still has low, medium and high frequency bands.
    "original_max_position_embeddings": 32,
}

# (id, architecture, config overrides) of the tiny random models checked for parity.
VARIANTS = [
    ("llama", "LlamaForCausalLM", {}),
    ("llama-llama3-rope", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    ("llama-tied", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    ("llama-bias", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("mistral", "MistralForCausalLM", {"sliding_window": None}),
    ("qwen2", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    ("qwen3", "Qwen3ForCausalLM", {"tie_word_embeddings": False}),
]


@pytest.fixture(params=VARIANTS, ids=[v[0] for v in VARIANTS])
def tiny_path(request: pytest.FixtureRequest, tiny_model_dir) -> Path:
    _, architecture, overrides = request.param
    return tiny_model_dir(architecture, **overrides)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are small: one thread avoids OpenMP oversubscription on a busy CI box
    (results do not depend on the thread count)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------- helpers


@lru_cache(maxsize=16)
def _hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@lru_cache(maxsize=16)
def _our_model(path: str, dtype: torch.dtype = torch.float32) -> CausalLM:
    return load_model(path, dtype=dtype, attn_backend=TorchAttentionBackend())


def _hf_logits(path: Path, token_ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        return _hf_model(str(path))(torch.tensor([list(token_ids)])).logits[0].float()


def _kv_caches(model: CausalLM, dtype: torch.dtype = torch.float32) -> list:
    cfg = model.config
    shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(cfg.num_layers)
    ]


def _step(
    model: CausalLM,
    kv_caches: list,
    seqs: Sequence[Sequence[int]],
    done: Sequence[int],
    new: Sequence[int],
    block_tables: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """One engine step: sequence i computes tokens ``done[i] .. done[i] + new[i]`` over its
    cached prefix. Returns the logits of each sequence's new tokens."""
    ids = [t for s, d, n in zip(seqs, done, new, strict=True) for t in s[d : d + n]]
    seq_lens = [d + n for d, n in zip(done, new, strict=True)]
    meta, positions = build_attention_metadata(block_tables, seq_lens, new, BLOCK_SIZE)
    model.plan_attention(meta)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), positions, kv_caches, meta)
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    return list(logits.split(list(new)))


def _random_ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _check_chunked_then_decode(path: Path, ids: list[int], chunks: Sequence[int]) -> float:
    """Prefill in ``chunks`` (each over the cached prefix), then decode token by token."""
    model = _our_model(str(path))
    ref = _hf_logits(path, ids)
    kv = _kv_caches(model)
    table = [[7, 2, 5, 10]]  # non-contiguous, not in order
    worst, done = 0.0, 0
    steps = list(chunks) + [1] * (len(ids) - sum(chunks))
    for n in steps:
        (logits,) = _step(model, kv, [ids], [done], [n], table)
        worst = max(worst, _max_diff(logits, ref[done : done + n]))
        done += n
    return worst


def _check_two_sequences(path: Path, a: list[int], b: list[int]) -> float:
    """Two requests of different lengths share every step: a mixed prefill step, a mixed
    decode + chunk step, then pure decode steps of unequal context lengths."""
    model = _our_model(str(path))
    ref_a, ref_b = _hf_logits(path, a), _hf_logits(path, b)
    kv = _kv_caches(model)
    tables = [[3, 9], [4, 0, 8]]
    plan = [  # (new tokens of a, new tokens of b)
        (len(a) - 3, len(b) - 8),
        (1, 5),
        (1, 1),
        (1, 1),
        (None, 1),
    ]
    done = [0, 0]
    worst = 0.0
    for new_a, new_b in plan:
        active = [(0, new_a, a, ref_a), (1, new_b, b, ref_b)]
        active = [x for x in active if x[1] is not None]
        out = _step(
            model,
            kv,
            [x[2] for x in active],
            [done[x[0]] for x in active],
            [x[1] for x in active],
            [tables[x[0]] for x in active],
        )
        for (i, n, _, ref), logits in zip(active, out, strict=True):
            worst = max(worst, _max_diff(logits, ref[done[i] : done[i] + n]))
            done[i] += n
    assert done == [len(a), len(b)]
    return worst


# --------------------------------------------------------------------------- tiny models


def test_prefill_matches_transformers(tiny_path: Path) -> None:
    ids = _random_ids(256, 37, seed=1)
    (logits,) = _step(
        _our_model(str(tiny_path)),
        _kv_caches(_our_model(str(tiny_path))),
        [ids],
        [0],
        [len(ids)],
        [[5, 1, 11]],
    )
    ref = _hf_logits(tiny_path, ids)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero numbers
    assert _max_diff(logits, ref) < ATOL


def test_chunked_prefill_then_decode_matches_transformers(tiny_path: Path) -> None:
    ids = _random_ids(256, 40, seed=2)
    assert _check_chunked_then_decode(tiny_path, ids, chunks=(13, 12)) < ATOL


def test_two_sequences_in_one_batch_match_transformers(tiny_path: Path) -> None:
    a, b = _random_ids(256, 21, seed=3), _random_ids(256, 34, seed=4)
    assert _check_two_sequences(tiny_path, a, b) < ATOL


def test_tied_embeddings_share_one_tensor(tiny_model_dir) -> None:
    path = tiny_model_dir("LlamaForCausalLM", tie_word_embeddings=True)
    assert "lm_head.weight" not in _read_tensors(path)
    model = _our_model(str(path))
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_untied_embeddings_load_their_own_head(tiny_model_dir) -> None:
    path = tiny_model_dir("LlamaForCausalLM")
    model = _our_model(str(path))
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, _read_tensors(path)["lm_head.weight"])


def test_tied_checkpoint_that_also_stores_the_head_loads(tiny_model_dir, tmp_path) -> None:
    src = tiny_model_dir("LlamaForCausalLM", tie_word_embeddings=True)
    _copy_config(src, tmp_path)
    tensors = _read_tensors(src)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, attn_backend=TorchAttentionBackend())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bf16_loads_and_runs(tiny_model_dir) -> None:
    path = tiny_model_dir("Qwen3ForCausalLM", tie_word_embeddings=False)
    model = load_model(path, dtype=torch.bfloat16, attn_backend=TorchAttentionBackend())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = _random_ids(256, 20, seed=5)
    kv = _kv_caches(model, torch.bfloat16)
    (prefill,) = _step(model, kv, [ids], [0], [19], [[2, 6]])
    (decode,) = _step(model, kv, [ids], [19], [1], [[2, 6]])
    logits = torch.cat((prefill, decode))
    ref = _hf_logits(path, ids)
    assert torch.isfinite(logits).all()
    # bf16 keeps ~3 significant digits: close to the float32 reference, not equal.
    assert _max_diff(logits, ref) < 0.05 * ref.abs().max().item()


def test_sharded_checkpoint_loads(tiny_model_dir, tmp_path) -> None:
    src = tiny_model_dir("Qwen2ForCausalLM", tie_word_embeddings=False)
    _hf_model(str(src)).save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = load_model(tmp_path, attn_backend=TorchAttentionBackend())
    single = _our_model(str(src))
    for (name, a), (_, b) in zip(
        sharded.named_parameters(), single.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- loader errors


def test_unsupported_architecture_is_rejected(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model(tmp_path, attn_backend=TorchAttentionBackend())
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(info.value)
        assert name in supported_architectures()


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [pytest.param(arch, overrides, id=name) for name, arch, overrides in VARIANTS
     if name in MODEL_TYPES],
)  # fmt: skip
def test_config_without_architectures_loads_by_model_type(
    tiny_model_dir, tmp_path, architecture: str, overrides: dict
) -> None:
    src = tiny_model_dir(architecture, **overrides)
    _copy_config(src, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]  # model_type stays, as transformers wrote it
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")

    model = load_model(tmp_path, attn_backend=TorchAttentionBackend())
    assert model.config.architecture == architecture
    ids = _random_ids(256, 19, seed=6)
    (logits,) = _step(model, _kv_caches(model), [ids], [0], [len(ids)], [[3, 1]])
    with_arch = _our_model(str(src))
    (expected,) = _step(with_arch, _kv_caches(with_arch), [ids], [0], [len(ids)], [[3, 1]])
    assert torch.equal(logits, expected)


def test_model_types_agree_with_transformers() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(MODEL_TYPES) == {
        "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
        "gemma3_text", "phi3",
    }
    for model_type, architecture in MODEL_TYPES.items():
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == architecture


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"model_type": None}, "model_type None"),
        ({"architectures": [], "model_type": "bert"}, "model_type 'bert'"),
        # A known backbone under another head is not a causal LM: model_type does not rescue it.
        ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ],
)
def test_unidentified_model_lists_what_is_supported(overrides: dict, named: str) -> None:
    raw = _raw_config(**overrides)
    if "architectures" not in overrides:
        del raw["architectures"]
    with pytest.raises(ValueError, match="unsupported") as info:
        ModelConfig.from_hf_dict(raw)
    message = str(info.value)
    assert named in message
    for name in supported_architectures() + supported_model_types():
        assert name in message


def test_missing_tensor_is_rejected(tiny_model_dir, tmp_path) -> None:
    src = tiny_model_dir("LlamaForCausalLM")
    _copy_config(src, tmp_path)
    tensors = {k: t for k, t in _read_tensors(src).items() if "layers.1.mlp.up_proj" not in k}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        load_model(tmp_path, attn_backend=TorchAttentionBackend())


def test_unexpected_or_misshapen_tensor_is_rejected(tiny_model_dir, tmp_path) -> None:
    src = tiny_model_dir("LlamaForCausalLM")
    _copy_config(src, tmp_path)
    tensors = _read_tensors(src)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.bias"):
        load_model(tmp_path, attn_backend=TorchAttentionBackend())
    del tensors["model.layers.0.self_attn.q_proj.bias"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(63, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="shape mismatch"):
        load_model(tmp_path, attn_backend=TorchAttentionBackend())


def test_unsupported_dtype_is_rejected(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_model_dir("LlamaForCausalLM"), dtype=torch.int8)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in list(f.keys())}


def _copy_config(src: Path, dst: Path) -> None:
    for name in ("config.json", "generation_config.json"):
        if (src / name).is_file():
            (dst / name).write_text((src / name).read_text())


# --------------------------------------------------------------------------- config


def _raw_config(**overrides) -> dict:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
    }
    raw.update(overrides)
    return raw


def test_legacy_and_transformers5_rope_fields_agree() -> None:
    legacy = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    old = parse_rope(_raw_config(rope_theta=10000.0, rope_scaling=legacy))
    new = parse_rope(_raw_config(rope_parameters=LLAMA3_ROPE))
    assert old == new
    assert old.rope_type == "llama3" and old.factor == 8.0
    assert parse_rope(_raw_config(rope_theta=5e5)) == RopeConfig(theta=5e5)
    assert parse_rope(_raw_config(rope_scaling={"type": "linear", "factor": 2.0})).factor == 2.0


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters=LLAMA3_ROPE)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(32, parse_rope({"rope_parameters": LLAMA3_ROPE}))
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, rope_inv_freq(32, RopeConfig(theta=10000.0)))


def test_unsupported_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="yarn"):
        parse_rope(_raw_config(rope_parameters={"rope_type": "yarn", "factor": 4.0}))


def test_config_fields_and_kv_bytes() -> None:
    cfg = ModelConfig.from_hf_dict(_raw_config(head_dim=16), {"eos_token_id": [7, 9, 7]})
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 8, 2, 16)
    assert cfg.eos_token_ids == (7, 9)
    # K and V, per layer, per KV head, per head_dim element.
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * 3 * 2 * 16 * 4
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 2 * 3 * 2 * 16 * 2
    assert ModelConfig.from_hf_dict(_raw_config(eos_token_id=5)).eos_token_ids == (5,)
    assert ModelConfig.from_hf_dict(_raw_config()).head_dim == 8


def test_architecture_quirks() -> None:
    qwen2 = ModelConfig.from_hf_dict(_raw_config(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.qkv_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf_dict(_raw_config(architectures=["Qwen3ForCausalLM"]))
    assert qwen3.qk_norm and not qwen3.qkv_bias


def test_sliding_windows_per_layer_and_the_full_context() -> None:
    """A window no longer caps the context: each layer gets its window, as transformers sets
    it (tests/engine/test_model_families.py runs the windowed models)."""
    mistral = ModelConfig.from_hf_dict(
        _raw_config(architectures=["MistralForCausalLM"], sliding_window=128)
    )
    assert mistral.max_position_embeddings == 512
    assert mistral.layer_windows == (128, 128, 128)
    qwen_off = _raw_config(
        architectures=["Qwen2ForCausalLM"], sliding_window=128, use_sliding_window=False
    )
    assert ModelConfig.from_hf_dict(qwen_off).layer_windows == ()
    qwen_on = _raw_config(
        architectures=["Qwen2ForCausalLM"],
        sliding_window=128,
        use_sliding_window=True,
        max_window_layers=1,
    )
    assert ModelConfig.from_hf_dict(qwen_on).layer_windows == (None, 128, 128)
    gemma2 = _raw_config(
        architectures=["Gemma2ForCausalLM"], sliding_window=64,
        hidden_activation="gelu_pytorch_tanh",
    )
    assert ModelConfig.from_hf_dict(gemma2).layer_windows == (64, None, 64)
    typed = _raw_config(
        sliding_window=8, layer_types=["full_attention", "sliding_attention", "full_attention"]
    )
    assert ModelConfig.from_hf_dict(typed).layer_windows == (None, 8, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_key_value_heads": 3}, "multiple"),
        ({"hidden_size": None}, "hidden_size"),
        ({"architectures": [], "model_type": "gpt2"}, "gpt2"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_config_is_rejected(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(_raw_config(**overrides))


# --------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smol_prompt(default_model_path: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def test_default_model_files(default_model_path: Path) -> None:
    start = time.perf_counter()
    assert default_module.default_model_path() == default_model_path
    assert time.perf_counter() - start < 1.0  # cached: no second conversion
    cfg = ModelConfig.from_hf_dir(default_model_path)
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert cfg.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert "<|im_start|>" in tokenizer.chat_template


def test_cache_root_follows_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    assert default_model.cache_root() == tmp_path
    assert default_model.default_model_dir() == tmp_path / default_model.DEFAULT_MODEL_NAME
    with pytest.raises(FileNotFoundError, match="services.engine.models.default"):
        default_model.converted_default_model()  # not converted there: says how to


def test_smollm2_prefill_matches_transformers(default_model_path, smol_prompt) -> None:
    model = _our_model(str(default_model_path))
    (logits,) = _step(model, _kv_caches(model), [smol_prompt], [0], [len(smol_prompt)], [[9, 4, 6]])
    assert _max_diff(logits, _hf_logits(default_model_path, smol_prompt)) < ATOL


def test_smollm2_prefill_then_decode_matches_transformers(default_model_path, smol_prompt) -> None:
    n = len(smol_prompt)
    assert _check_chunked_then_decode(default_model_path, smol_prompt, (n - 14, 8)) < ATOL


def test_smollm2_two_sequences_in_one_batch(default_model_path, smol_prompt) -> None:
    other = smol_prompt[:-1] + _random_ids(49152, 6, seed=6) + smol_prompt[-1:]
    assert _check_two_sequences(default_model_path, smol_prompt[:22], other) < ATOL
