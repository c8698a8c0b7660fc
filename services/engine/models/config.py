"""Model configuration parsed from a Hugging Face model directory (``config.json``, read by
``services.common.model_files``, the one reader of those files and of the end-of-sequence rule).

Only the fields the engine needs are kept, under our own names, so that the rest of the engine
never touches a transformers config object. Architecture-specific quirks (Qwen2's q/k/v bias,
Qwen3's q/k norms, Gemma's layer pattern) come from the registry, which is the one list of
supported architectures; the families' own fields (sliding windows, soft-caps, experts,
longrope) are parsed here, each into a field that says what it does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.model_files import ModelFiles, context_length, eos_token_ids, generation_field
from services.engine.models.registry import get_arch_spec, resolve_architecture

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding parameters (transformers 5 ``rope_parameters`` semantics)."""

    theta: float = _DEFAULT_ROPE_THETA
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # "linear" and "llama3"
    low_freq_factor: float = 1.0  # "llama3" only
    high_freq_factor: float = 4.0  # "llama3" only
    original_max_position_embeddings: int = 0  # "llama3", "longrope": the pretraining context
    # "longrope" (Phi-3): per-frequency divisors for requests up to the pretraining context
    # (short) and beyond it (long), and the factor cos/sin are multiplied by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be positive")
        if self.rope_type == "llama3":
            if self.original_max_position_embeddings <= 0:
                raise ValueError("llama3 rope needs original_max_position_embeddings > 0")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")
        if self.rope_type == "longrope":
            if self.original_max_position_embeddings <= 0:
                raise ValueError("longrope needs original_max_position_embeddings > 0")
            if len(self.short_factor) != len(self.long_factor) or not self.short_factor:
                raise ValueError("longrope needs short_factor and long_factor of equal length")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token goes to ``top_k`` of ``num_experts`` SwiGLU experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # Renormalise the top-k router probabilities to sum to 1 (Mixtral always; Qwen by
    # norm_topk_prob). Mixtral also keeps the weights in float32 (Qwen casts them to the dtype).
    normalize_top_k: bool
    float32_weights: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP
    shared_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated shared expert; 0 = none

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.top_k}"
            )
        if self.intermediate_size <= 0:
            raise ValueError("the experts' intermediate size must be positive")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only model."""

    architecture: str  # HF ``architectures[0]`` (else from model_type), e.g. "LlamaForCausalLM"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_pytorch_tanh"
    # Per layer: its sliding window (keys p - w < k <= p) or None for full attention; empty
    # when no layer has one.
    layer_windows: tuple[int | None, ...] = ()
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the LM head's logits
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' own RoPE
    moe: MoeConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    checkpoint_dtype: str | None = None  # dtype the weights were saved in, informational
    # config.json's quantization_config, as stored (``services.engine.quantization`` reads it)
    quantization: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attn_scale(self) -> float:
        scalar = self.query_pre_attn_scalar
        return (self.head_dim if scalar is None else scalar) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cache one token occupies across all layers."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Parses ``config.json`` (and ``generation_config.json`` for eos ids) in ``path``."""
        files = ModelFiles.read(path)
        return cls.from_hf_dict(files.config, files.generation)

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Builds a config from parsed ``config.json`` (+ ``generation_config.json``) dicts."""
        # Raises ValueError, naming the supported ones, when neither names a supported model.
        architecture = resolve_architecture(raw.get("architectures"), raw.get("model_type"))
        spec = get_arch_spec(architecture)
        hidden = _required_int(raw, "hidden_size")
        heads = _required_int(raw, "num_attention_heads")
        attention_bias = bool(raw.get("attention_bias", False))
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act != spec.activation:
            raise ValueError(
                f"unsupported hidden_act {act!r} for {architecture}; only {spec.activation!r}"
            )
        num_layers = _required_int(raw, "num_hidden_layers")
        generation = generation or {}
        return cls(
            architecture=architecture,
            model_type=str(raw.get("model_type", "")),
            vocab_size=_required_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            # head_dim may be absent, null, or differ from hidden // heads (Qwen3, Mistral).
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=_context_length(raw),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if spec.qkv_bias is None else spec.qkv_bias,
            o_proj_bias=attention_bias if spec.o_proj_bias is None else spec.o_proj_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            hidden_act=act,
            layer_windows=_layer_windows(raw, num_layers, spec.sliding_pattern),
            query_pre_attn_scalar=_optional_float(raw.get("query_pre_attn_scalar")),
            attn_logit_softcap=_optional_float(raw.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(raw.get("final_logit_softcapping")),
            local_rope=parse_local_rope(raw),
            moe=parse_moe(raw, num_layers),
            eos_token_ids=eos_token_ids(raw, generation),
            bos_token_id=_optional_int(generation_field(raw, generation, "bos_token_id")),
            pad_token_id=_optional_int(generation_field(raw, generation, "pad_token_id")),
            checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            quantization=raw.get("quantization_config"),
        )


def parse_rope(raw: dict[str, Any], layer_type: str = "full_attention") -> RopeConfig:
    """Reads ``rope_parameters`` (transformers 5) or legacy ``rope_theta``/``rope_scaling``;
    per-layer-type parameters (Gemma 3) give ``layer_type``'s."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        if layer_type not in params:
            raise ValueError(f"rope_parameters has no {layer_type!r} entry")
        params = params[layer_type]
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # Phi-3's early name for longrope
        rope_type = "longrope"
    theta = params.get("rope_theta", raw.get("rope_theta")) or _DEFAULT_ROPE_THETA
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings") or raw.get(
            "max_position_embeddings", 0
        )
        return RopeConfig(
            theta=float(theta),
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    if rope_type == "longrope":
        return _longrope(raw, params, float(theta))
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")


def _longrope(raw: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """Phi-3's longrope; without ``factor`` the context's growth over the pretraining context
    sets the attention factor, as transformers does."""
    original = params.get("original_max_position_embeddings") or raw.get(
        "original_max_position_embeddings", 0
    )
    factor = params.get("factor") or _required_int(raw, "max_position_embeddings") / max(
        int(original), 1
    )
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(original)))
        )
    return RopeConfig(
        theta=theta,
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        attention_factor=float(attention_factor),
    )


def parse_local_rope(raw: dict[str, Any]) -> RopeConfig | None:
    """Gemma 3's sliding layers rotate with their own base: a ``sliding_attention`` entry of
    per-layer-type ``rope_parameters``, or the legacy ``rope_local_base_freq``."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        return parse_rope(raw, "sliding_attention")
    if raw.get("rope_local_base_freq") is not None:
        return RopeConfig(theta=float(raw["rope_local_base_freq"]))
    return None


def parse_moe(raw: dict[str, Any], num_layers: int) -> MoeConfig | None:
    """Qwen-MoE (``moe_intermediate_size``) or Mixtral experts. The expert count is
    ``num_experts`` or ``num_local_experts`` (transformers 5 writes the latter for both)."""
    num_experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not num_experts:
        return None
    top_k = _required_int(raw, "num_experts_per_tok")
    if not raw.get("moe_intermediate_size"):  # Mixtral: every layer, float32 weights
        return MoeConfig(
            num_experts=int(num_experts),
            top_k=top_k,
            intermediate_size=_required_int(raw, "intermediate_size"),
            normalize_top_k=True,
            float32_weights=True,
            sparse_layers=(True,) * num_layers,
        )
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return MoeConfig(
        num_experts=int(num_experts),
        top_k=top_k,
        intermediate_size=int(raw["moe_intermediate_size"]),
        normalize_top_k=bool(raw.get("norm_topk_prob", False)),
        float32_weights=False,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
    )


def _layer_windows(raw: dict[str, Any], num_layers: int, pattern: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers decides it.

    ``layer_types`` (transformers 5) names each layer's kind. Older configs: Qwen2/Qwen3 window
    the layers from ``max_window_layers`` on, and only with ``use_sliding_window``; Gemma makes
    every ``pattern``-th layer global (``sliding_window_pattern``); the rest window every layer.
    """
    window = raw.get("sliding_window")
    if not window or ("use_sliding_window" in raw and not raw["use_sliding_window"]):
        return ()
    window = int(window)
    types = raw.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if "use_sliding_window" in raw:
        start = int(raw.get("max_window_layers") or 0)
        return tuple(window if i >= start else None for i in range(num_layers))
    pattern = int(raw.get("sliding_window_pattern") or pattern)
    if pattern:
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    return (window,) * num_layers


def _required_int(raw: dict[str, Any], key: str) -> int:
    if raw.get(key) is None:
        raise ValueError(f"config.json is missing {key!r}")
    return int(raw[key])


def _context_length(raw: dict[str, Any]) -> int:
    value = context_length(raw)
    if value is None:
        raise ValueError("config.json is missing 'max_position_embeddings'")
    return value


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
