"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

The attention and the decoder layer are Llama's; a sparse layer's MLP is a ``SparseMoeBlock``:
a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token and the token's output is
the weighted sum of theirs (plus, in Qwen2-MoE, a sigmoid-gated shared expert).

Experts are fused at load time: the loader stacks every expert's gate and up projections into
one ``[E * 2I, H]`` tensor and the down projections into ``[E * H, I]`` (each HF tensor is a
stacked shard, as q/k/v are in ``qkv_proj``). How tokens reach them is the bound kernels'
``experts`` path (``models.experts``): grouped on the host on the CPU, routed on the device on
a GPU (no host sync, CUDA-graph safe, work proportional to the routed tokens).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.engine.attention.base import AttentionBackend
from services.engine.models.layers import Linear, UsesKernels, empty_param
from services.engine.models.llama import LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from services.engine.models.config import ModelConfig, MoeConfig


class ExpertWeights(nn.Module):
    """Every expert's weight of one kind, stacked: ``[E * rows_per_expert, cols]``."""

    def __init__(
        self, num_experts: int, shards: tuple[int, ...], cols: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.shard_sizes = shards * num_experts  # the loader's stacking order, expert-major
        self.weight = empty_param(sum(self.shard_sizes), cols, dtype=dtype)

    def per_expert(self) -> torch.Tensor:
        return self.weight.view(self.num_experts, -1, self.weight.shape[1])


class FusedExperts(UsesKernels):
    def __init__(self, moe: MoeConfig, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        inter = moe.intermediate_size
        self.gate_up = ExpertWeights(moe.num_experts, (inter, inter), hidden_size, dtype)
        self.down = ExpertWeights(moe.num_experts, (hidden_size,), inter, dtype)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        gate_up, down = self.gate_up.per_expert(), self.down.per_expert()
        return self.kernels.experts(x, gate_up, down, weights, experts)


def route(
    logits: torch.Tensor, moe: MoeConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, top_k]``, expert ids ``[T, top_k]``): softmax over every expert in float32,
    the top k, renormalised when the family does; Mixtral keeps float32 weights."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, moe.top_k, dim=-1)
    if moe.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if moe.float32_weights else weights.to(dtype)), experts


class SparseMoeBlock(nn.Module):
    """Router + fused experts (+ the shared expert of Qwen2-MoE)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe = moe
        # Routers stay in full precision whatever the checkpoint's scheme (as vLLM's).
        self.gate = Linear(config.hidden_size, (moe.num_experts,), bias=False, dtype=dtype,
                           quantizable=False)
        self.experts = FusedExperts(moe, config.hidden_size, dtype)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_intermediate_size:
            shared = replace(config, intermediate_size=moe.shared_intermediate_size)
            self.shared_expert = LlamaMLP(shared, dtype)
            self.shared_expert_gate = Linear(config.hidden_size, (1,), bias=False, dtype=dtype,
                                             quantizable=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.moe, x.dtype)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class _MoeForCausalLM(LlamaForCausalLM):
    """Llama's decoder with a ``SparseMoeBlock`` as the MLP of every sparse layer."""

    # The HF names of one expert's (gate, up, down) projections.
    expert_names: tuple[str, str, str]

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if config.moe is None:
            raise ValueError(
                f"{config.architecture} needs num_experts (or num_local_experts) and "
                "num_experts_per_tok in config.json"
            )
        super().__init__(config, attn_backend, dtype)
        for layer, sparse in zip(self.model.layers, config.moe.sparse_layers, strict=True):
            if sparse:
                layer.mlp = SparseMoeBlock(config, dtype)

    def stacked_params(self) -> dict[str, tuple[str, ...]]:
        gate, up, down = self.expert_names
        experts = range(self.config.moe.num_experts)
        return {
            **super().stacked_params(),
            "gate_up": tuple(f"{e}.{name}" for e in experts for name in (gate, up)),
            "down": tuple(f"{e}.{down}" for e in experts),
        }


class QwenMoeForCausalLM(_MoeForCausalLM):
    """Qwen2-MoE (q/k/v bias, shared expert) and Qwen3-MoE (q/k norms)."""

    expert_names = ("gate_proj", "up_proj", "down_proj")


class MixtralForCausalLM(_MoeForCausalLM):
    expert_names = ("w1", "w3", "w2")

    def checkpoint_name(self, name: str) -> str:
        # Mixtral checkpoints call the MoE MLP block_sparse_moe; ours is every layer's mlp.
        return name.replace(".block_sparse_moe.", ".mlp.")
