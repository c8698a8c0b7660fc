"""The Llama decoder; Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) are
switches on it (see ``ModelConfig.qkv_bias`` / ``qk_norm``).

Works on one flattened batch (``[T, hidden]``, no batch dim): the attention backend finds the
request boundaries in ``AttentionMetadata``. Q/K/V and gate/up are each one fused matmul; the
loader stacks the HF weights into them. Under tensor parallelism every rank builds the same
model over its shard (``services.engine.models.parallel_layers``): its heads, its MLP rows, its
vocabulary rows; at one rank those layers are the plain ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention.base import AttentionBackend, AttentionLayout, AttentionMetadata
from services.engine.models.layers import (
    CausalLM,
    HeadRMSNorm,
    KVCache,
    RMSNorm,
    RopeStep,
    RotaryEmbedding,
    UsesKernels,
    apply_rotary,
)
from services.engine.models.onednn import PackedWeight, can_pack, pack, packed_linear
from services.engine.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from services.engine.models.pipeline_stage import IntermediateTensors, stage_output

if TYPE_CHECKING:
    from services.engine.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            bias=config.qkv_bias,
            dtype=dtype,
        )
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.qkv_proj.q_size
        self.qk_size = self.q_size + self.qkv_proj.kv_size  # q and k are roped together
        self.scale = config.attn_scale
        self.window: int | None = None  # this layer's sliding window; set by the model
        self.softcap = config.attn_logit_softcap
        self.backend = attn_backend
        self.o_proj = RowParallelLinear(
            config.q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype
        )
        self.qk_norm = (
            HeadRMSNorm(
                self.num_heads, self.num_kv_heads, config.head_dim, config.rms_norm_eps, dtype
            )
            if config.qk_norm
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # Views into qkv, no copies: [T, q_heads + kv_heads, d] and [T, kv_heads, d].
        qk = qkv[:, : self.qk_size].view(num_tokens, -1, self.head_dim)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = apply_rotary(qk, rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        k_cache, v_cache = kv_cache
        self.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.forward(
            q, k_cache, v_cache, meta, self.scale, window=self.window, softcap=self.softcap
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(UsesKernels):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, (inter, inter), bias=config.mlp_bias, dtype=dtype
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, residual stream before it); the next layer's input
        norm adds the two, so each residual add is fused into a norm. ``residual`` is updated
        in place (it is a tensor this forward pass owns: the embedding output, then sums)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend, dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope, dtype
        )
        for i, layer in enumerate(self.layers):
            layer.self_attn.window = config.window(i)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        rope = self.rotary(positions)  # once per step, shared by all layers
        residual: torch.Tensor | None = None
        if intermediate is None:
            h = self.embed_tokens(input_ids)
        else:  # a later pipeline stage: where the previous one stopped
            h, residual = intermediate.hidden, intermediate.residual
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv_cache, meta)
        return stage_output(self.norm, h, residual)


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a flattened batch with a paged KV cache."""

    model_class: type[nn.Module] = LlamaModel  # the decoder stack (other families swap it)

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, attn_backend, dtype)
        self.lm_head: VocabParallelEmbedding | ParallelLMHead
        if config.tie_word_embeddings:
            # The same module: one weight in memory, listed once by named_parameters().
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, dtype)
        self._tied_head: PackedWeight | None = None
        self.compute_dtype = dtype
        self._attn_layout: AttentionLayout | None = None

    def plan_attention(self, meta: AttentionMetadata) -> None:
        """Builds the step's attention plan once, for every layer to read (``meta.plan``)."""
        layers = [layer.self_attn for layer in self.model.layers]
        first = layers[0]
        if self._attn_layout is None:  # the layers' windows are set once the model is built
            self._attn_layout = AttentionLayout(
                num_heads=first.num_heads,
                num_kv_heads=first.num_kv_heads,
                dtype=self.compute_dtype,
                windows=frozenset(a.window for a in layers),
                softcap=first.softcap,
            )
        meta.plan = first.backend.plan(meta, self._attn_layout)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """``input_ids``/``positions``: ``[T]``; returns the final hidden states ``[T, hidden]``
        (a pipeline stage: see ``CausalLM.forward``)."""
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden``: ``[N, hidden]`` (only the rows that need logits); returns float32, on
        rank 0 (None on the other tensor-parallel ranks)."""
        return self.lm_head.gather_logits(self.shard_logits(hidden))

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits, float32 ``[N, rows]`` (the shard's
        padding included): every rank, no collective (``shard_sampling``)."""
        if self._tied_head is not None:
            logits = packed_linear(hidden, self._tied_head)
        elif isinstance(self.lm_head, ParallelLMHead):
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.lm_head.weight)
        return logits.float()

    def pack_weights(self) -> None:
        super().pack_weights()
        # A tied head shares the embedding table, which lookups still need as it is: the head
        # gets a packed copy of its own.
        # (a pipeline stage before the last has no head: ``pipeline_stage``)
        if isinstance(self.lm_head, VocabParallelEmbedding) and can_pack(self.lm_head.weight):
            self._tied_head = pack(self.lm_head.weight)

    def stacked_params(self) -> dict[str, tuple[str, ...]]:
        return {
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
            "qk_norm": ("q_norm", "k_norm"),
        }

    def reset_buffers(self) -> None:
        self.model.rotary.reset_cache()
