"""Phi-3: Llama's decoder with the checkpoint's own fused projections and longrope.

The checkpoint already stores ``qkv_proj`` and ``gate_up_proj`` fused, in our row order
(q, k, v; gate, up), so nothing is stacked at load time.

Longrope (the 128k-context Phi-3 models) divides each RoPE frequency by a per-frequency factor,
``short_factor`` within the pretraining context (``original_max_position_embeddings``, O) and
``long_factor`` beyond it, and multiplies cos/sin by an attention factor. We choose by the
token's position: positions below O rotate short, the others long. A token's rotation then
never depends on how it was scheduled (alone or batched, in which chunk, recomputed after a
preemption, or served from the prefix cache), and it equals transformers' whenever the prompt
fits in O, generation past O included (transformers' cached decode switches to long there too).
It differs for a prompt longer than O: transformers rotates that whole prompt long, its first
O tokens included. The table holds both: rows ``[0, P)`` short, ``[P, 2P)`` long.
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
        # Device-side only, so a CUDA graph replays it.
        is_long = positions >= self.rope.original_max_position_embeddings
        return super().forward(positions + is_long * self.num_positions)


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

    def stacked_params(self) -> dict[str, tuple[str, ...]]:
        return {}  # qkv_proj and gate_up_proj come fused in the checkpoint
