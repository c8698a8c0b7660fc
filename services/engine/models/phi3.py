"""Phi-3: Llama's decoder with the checkpoint's own fused projections and longrope.

The checkpoint already stores ``qkv_proj`` and ``gate_up_proj`` fused, in our row order
(q, k, v; gate, up), so nothing is stacked at load time.

Longrope (the 128k-context Phi-3 models) divides each RoPE frequency by a per-frequency factor,
``short_factor`` for sequences within the pretraining context (``original_max_position_embeddings``,
O) and ``long_factor`` for longer ones, and multiplies cos/sin by an attention factor.

transformers picks the factors per sequence and, in ``generate``, recomputes the whole KV cache
with the long factors when a sequence first grows past O. A serving engine cannot let a
token's KV depend on how long its sequence later grows (the prefix cache, preemption and
batching all assume it does not), so, as vLLM, we pick once per engine: long factors for every
token when the engine serves contexts longer than O (``max_model_len``, by default the model's
``max_position_embeddings``), short ones when it is limited to O (``--max-model-len O``). Either
way the result equals transformers' for the sequences it would compute the same way: all of
them up to O with ``--max-model-len O``, those longer than O from their first token otherwise.
The table holds both: rows ``[0, P)`` short, ``[P, 2P)`` long.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.engine.attention.base import AttentionBackend
from services.engine.models.layers import RopeStep, RotaryEmbedding, cos_sin_table
from services.engine.models.llama import LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from services.engine.models.config import ModelConfig, RopeConfig


def longrope_inv_freq(head_dim: int, rope: RopeConfig, long: bool) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    return 1.0 / (factors * rope.theta**exponents)


class LongRopeEmbedding(RotaryEmbedding):
    def __init__(
        self, head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype
    ) -> None:
        if len(rope.short_factor) != head_dim // 2:
            raise ValueError(
                f"longrope factors have {len(rope.short_factor)} entries; head_dim {head_dim} "
                f"needs {head_dim // 2}"
            )
        self.num_positions = max_positions
        self.use_long = max_positions > rope.original_max_position_embeddings
        super().__init__(head_dim, 2 * max_positions, rope, dtype)

    def reset_cache(self) -> None:
        if self.cos_sin.is_meta:
            return
        device, n = self.cos_sin.device, self.num_positions
        for half, long in ((slice(0, n), False), (slice(n, 2 * n), True)):
            inv_freq = longrope_inv_freq(self.head_dim, self.rope, long)
            self.cos_sin[half].copy_(
                cos_sin_table(inv_freq, n, device, self.rope.attention_factor)
            )

    def forward(self, positions: torch.Tensor) -> RopeStep:
        return super().forward(positions + self.num_positions if self.use_long else positions)


class Phi3Model(LlamaModel):
    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__(config, attn_backend, dtype)
        if config.rope.rope_type == "longrope":
            self.rotary = LongRopeEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope, dtype
            )


class Phi3ForCausalLM(LlamaForCausalLM):
    model_class = Phi3Model

    def limit_context(self, max_model_len: int) -> None:
        rotary = self.model.rotary
        if isinstance(rotary, LongRopeEmbedding):
            rotary.use_long = max_model_len > self.config.rope.original_max_position_embeddings

    def stacked_params(self) -> dict[str, tuple[str, ...]]:
        return {}  # qkv_proj and gate_up_proj come fused in the checkpoint
