"""Rank 0's validated adapter weights, sent to the other tensor-parallel ranks: a worker never
opens an adapter's files (a path is rank 0's to resolve inside the roots, and files edited in
place after a load must not reach a worker as other weights, or make it raise).

A step that copies an adapter into a slot carries, per copy, a *manifest* in its batch (one
int64 array: how many tensor pairs, then per pair: projection index, slice index, rank, A's
columns, B's rows); just before the step's forward every rank calls ``share``, and rank 0
broadcasts the pairs' bytes, in manifest order, on the step group. Each rank then cuts its
shard as it cut the base weight (``layers.LoRAProjection.install``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.engine.lora.peft import AdapterWeights
from services.engine.parallel.group import TPGroup
from services.engine.parallel.step_broadcast import broadcast_bytes

Tensors = dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]
_FIELDS = 5  # projection, slice, rank, A's columns, B's rows


def manifest(weights: AdapterWeights, paths: Sequence[str]) -> np.ndarray:
    index = {p: i for i, p in enumerate(paths)}
    entries = [(index[path], i, a.shape[0], a.shape[1], b.shape[0])
               for path, slices in weights.tensors.items() for i, (a, b) in slices.items()]
    return np.asarray([len(entries), *(v for e in entries for v in e)], dtype=np.int64)


def share(tp: TPGroup, plan: np.ndarray, weights: AdapterWeights | None,
          paths: Sequence[str], dtype: torch.dtype) -> Tensors:
    """Rank 0's tensors of ``weights`` on every rank (``weights``: rank 0's, None elsewhere)."""
    entries = plan[1:].reshape(-1, _FIELDS).tolist()
    assert len(entries) == int(plan[0]), "a malformed adapter manifest"
    size = dtype.itemsize
    nbytes = sum(r * cols + rows * r for _, _, r, cols, rows in entries) * size
    if tp.is_first:
        assert weights is not None
        parts = [t.contiguous().view(-1).view(torch.uint8)
                 for slices in weights.tensors.values() for a, b in slices.values()
                 for t in (a, b)]
        broadcast_bytes(tp, torch.cat(parts) if parts else None, nbytes)
        return weights.tensors
    flat = broadcast_bytes(tp, None, nbytes)
    out: Tensors = {}
    at = 0
    for proj, index, r, cols, rows in entries:
        a = flat[at : at + r * cols * size].view(dtype).view(r, cols)
        at += r * cols * size
        b = flat[at : at + rows * r * size].view(dtype).view(rows, r)
        at += rows * r * size
        out.setdefault(paths[proj], {})[index] = (a, b)
    return out
