"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

The attention and the decoder layer are Llama's; a sparse layer's MLP is a ``SparseMoeBlock``:
a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token and the token's output is
the weighted sum of theirs (plus, in Qwen2-MoE, a sigmoid-gated shared expert).

Experts are fused at load time: the loader stacks every expert's gate and up projections into
one ``[E * 2I, H]`` tensor and the down projections into ``[E * H, I]`` (each HF tensor is a
stacked shard, as q/k/v are in ``qkv_proj``). The computation is grouped, never a loop over
tokens::

    (token, choice) pairs      t0:e2 t0:e5 t1:e2 t2:e0 ...
    sorted by expert           e0:[t2]  e2:[t0 t1]  e5:[t0]      (experts with no token: skipped)
    per active expert          one [n_e, H] x [H, 2I] matmul, SwiGLU, one [n_e, I] x [I, H]
    back to tokens             one index_add over all rows, weighted by the router

Under CUDA graph capture the expert counts cannot be read on the host, so every expert runs
over every token with the router weights as a dense mask (same result, more work).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention.base import AttentionBackend
from services.engine.models.layers import Linear, empty_param, silu_and_mul
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


class FusedExperts(nn.Module):
    def __init__(self, moe: MoeConfig, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        inter = moe.intermediate_size
        self.gate_up = ExpertWeights(moe.num_experts, (inter, inter), hidden_size, dtype)
        self.down = ExpertWeights(moe.num_experts, (hidden_size,), inter, dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up.per_expert(), self.down.per_expert()
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return _dense_experts(x, gate_up, down, weights, experts)
        return grouped_experts(x, gate_up, down, weights, experts)


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


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, K]
    experts: torch.Tensor,  # [T, K]
) -> torch.Tensor:
    """Tokens sorted by expert, one pair of matmuls per expert that got any."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: each expert's tokens stay in order
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_k
    rows = x.index_select(0, tokens)
    row_weights = weights.reshape(-1).index_select(0, order)[:, None]
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        h = silu_and_mul(F.linear(rows[start:end], gate_up[expert]))
        out_rows[start:end] = F.linear(h, down[expert]) * row_weights[start:end]
        start = end
    # Rows are expert-major: each token's contributions are added in expert order, as
    # transformers adds them.
    return torch.zeros_like(x).index_add_(0, tokens, out_rows)


def _dense_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """Graph-capturable: every expert over every token, weighted 0 where it was not chosen."""
    dense = torch.zeros(x.shape[0], gate_up.shape[0], dtype=weights.dtype, device=x.device)
    dense.scatter_(1, experts, weights)
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        h = silu_and_mul(F.linear(x, gate_up[expert]))
        out += (F.linear(h, down[expert]) * dense[:, expert : expert + 1]).to(x.dtype)
    return out


class SparseMoeBlock(nn.Module):
    """Router + fused experts (+ the shared expert of Qwen2-MoE)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe = moe
        self.gate = Linear(config.hidden_size, (moe.num_experts,), bias=False, dtype=dtype)
        self.experts = FusedExperts(moe, config.hidden_size, dtype)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_intermediate_size:
            shared = replace(config, intermediate_size=moe.shared_intermediate_size)
            self.shared_expert = LlamaMLP(shared, dtype)
            self.shared_expert_gate = Linear(config.hidden_size, (1,), bias=False, dtype=dtype)

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
