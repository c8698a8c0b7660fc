"""Gemma 2 and Gemma 3 (text): Llama's attention and fused projections, Gemma's layer.

What differs from Llama, and where it lives:

* RMSNorm scales by ``1 + weight``: ``after_load`` adds the 1 to every norm weight once, so in
  float32 the ordinary ``RMSNorm``/``HeadRMSNorm`` (and their kernels) compute it unchanged; in
  bf16/fp16 the norms multiply by ``1 + weight`` in float32 and round once, as transformers
  (``GemmaRMSNorm``; rounding ``1 + weight`` to bf16 first moved logits by ~5%);
* the embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype, as HF);
* GeGLU (tanh-approximated GELU) instead of SwiGLU;
* four norms per layer: after attention and around the MLP, besides the input norm;
* scores scaled by ``query_pre_attn_scalar ** -0.5``, soft-capped (Gemma 2), and every
  ``pattern``-th layer global while the others slide (``ModelConfig.layer_windows``);
* Gemma 3's sliding layers rotate with their own RoPE base (``local_rope``), and q/k norms;
* the final logits soft-capped (Gemma 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention.base import AttentionBackend, AttentionMetadata
from services.engine.models.layers import (
    HeadRMSNorm,
    KVCache,
    RMSNorm,
    RopeStep,
    RotaryEmbedding,
)
from services.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from services.engine.models.parallel_layers import VocabParallelEmbedding
from services.engine.models.pipeline_stage import IntermediateTensors, stage_output

if TYPE_CHECKING:
    from services.engine.models.config import ModelConfig


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU on a fused ``[gate | up]`` projection (transformers' gelu_pytorch_tanh)."""
    half = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :half], approximate="tanh") * gate_up[..., half:]


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class GemmaRMSNorm(RMSNorm):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(size, eps, dtype)
        self.register_buffer("weight_f32", torch.empty(size), persistent=False)
        self.scaled = dtype != torch.float32  # see the module docstring

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.scaled:
            return super().forward(x, residual)
        if residual is not None:
            residual.add_(x)
            x = residual
        out = _scaled_rms(x, self.weight_f32, self.eps)
        return out if residual is None else (out, residual)


class GemmaHeadRMSNorm(HeadRMSNorm):
    def __init__(
        self, num_q_heads: int, num_kv_heads: int, head_dim: int, eps: float, dtype: torch.dtype
    ) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, eps, dtype)
        self.register_buffer(
            "weight_f32", torch.empty(num_q_heads + num_kv_heads, head_dim), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            return _scaled_rms(x, self.weight_f32, self.eps)
        return super().forward(x)


def _scaled_rms(x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight_f32).to(x.dtype)


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype, index: int
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend, dtype)
        self.self_attn.window = config.window(index)
        if config.qk_norm:  # Gemma 3
            self.self_attn.qk_norm = GemmaHeadRMSNorm(
                config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps, dtype
            )
        self.mlp = GemmaMLP(config, dtype)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer.forward``: each residual add is fused into the next norm."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype.
        self.normalizer = float(torch.tensor(config.hidden_size**0.5, dtype=dtype, device="cpu"))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, attn_backend, dtype, i) for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        max_pos = config.max_position_embeddings
        self.rotary = RotaryEmbedding(config.head_dim, max_pos, config.rope, dtype)
        self.rotary_local = (
            RotaryEmbedding(config.head_dim, max_pos, config.local_rope, dtype)
            if config.local_rope is not None
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        rope = self.rotary(positions)
        local = rope if self.rotary_local is None else self.rotary_local(positions)
        residual: torch.Tensor | None = None
        if intermediate is None:
            h = self.embed_tokens(input_ids) * self.normalizer
        else:  # a later pipeline stage (``LlamaModel.forward``)
            h, residual = intermediate.hidden, intermediate.residual
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer_rope = rope if layer.self_attn.window is None else local
            h, residual = layer(h, residual, layer_rope, kv_cache, meta)
        return stage_output(self.norm, h, residual)

    def reset_cache(self) -> None:
        self.rotary.reset_cache()
        if self.rotary_local is not None:
            self.rotary_local.reset_cache()


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 (text-only) causal LM; the LM head is tied to the embedding."""

    model_class = GemmaModel

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Element-wise, so capping each rank's columns equals capping the gathered row.
        logits = super().shard_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else soft_cap(logits, cap)

    def reset_buffers(self) -> None:
        self.model.reset_cache()

    @torch.no_grad()
    def after_load(self) -> None:
        # Gemma's norms scale by (1 + weight): fold the 1 in once, in float32 as HF adds it.
        for module in self.modules():
            if isinstance(module, (GemmaRMSNorm, GemmaHeadRMSNorm)):
                module.weight_f32.copy_(module.weight.float() + 1.0)
                module.weight.copy_(module.weight_f32)
