"""Attention backends called as the runner calls them: the step's plan first, then a layer."""

from __future__ import annotations

import torch

from services.engine.attention.base import AttentionBackend, AttentionLayout, AttentionMetadata


def attend(
    backend: AttentionBackend,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One layer's attention over ``meta``, planned for a model whose layers all have this
    head layout, ``window`` and ``softcap`` (a new plan each call, as a new step would)."""
    layout = AttentionLayout(query.shape[1], k_cache.shape[2], query.dtype,
                             frozenset({window}), softcap)
    meta.plan = backend.plan(meta, layout)
    return backend.forward(query, k_cache, v_cache, meta, scale, window, softcap)
