"""One step's adapter layout, built once per step and read by every LoRA projection.

From each scheduled request's slot (-1: the base model) and its number of new tokens:

* ``dense_slot``: every token of the step runs one adapter: each projection does two plain
  matmuls, nothing gathered;
* otherwise ``perm`` (the rows of tokens under an adapter, grouped by slot, in order) and
  ``groups`` (slot, start, end) into it: each projection gathers those rows once, does two
  matmuls per adapter in the step (at most ``max_loras``, never one per request) and adds the
  results back with one ``index_add_``;
* for the Triton kernels, ``segments``: (first token, tokens, slot) per request under an
  adapter, on the device.

A step with no adapter token gets no ``LoRAStep`` at all (``build`` returns None), and its
projections do nothing beyond reading that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class LoRAStep:
    dense_slot: int  # >= 0: every token runs this slot; -1: see perm/groups
    perm: torch.Tensor | None = None  # [N] int64 rows under an adapter, grouped by slot
    groups: tuple[tuple[int, int, int], ...] = ()  # (slot, start, end) into perm
    # Triton: [3, S] int32 (first token, tokens, slot) per request under an adapter, and the
    # longest such request (the kernels' grid).
    segments: torch.Tensor | None = None
    max_segment: int = 0


class LoRAState:
    """The field every LoRA projection of a model reads: the running step's layout (None for
    a step without adapters). Set once per step, on the thread that runs the model."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


def build(seq_slots: np.ndarray, query_lens: np.ndarray, device: torch.device,
          segments: bool = False) -> LoRAStep | None:
    """The layout of a step whose request i has ``query_lens[i]`` new tokens under slot
    ``seq_slots[i]``; None when no request has an adapter."""
    active = seq_slots >= 0
    if not active.any():
        return None
    if segments:
        starts = np.cumsum(query_lens) - query_lens
        seg = np.stack([starts[active], query_lens[active], seq_slots[active]]).astype(np.int32)
        return LoRAStep(-1, segments=torch.from_numpy(seg).to(device),
                        max_segment=int(query_lens[active].max()))
    first = int(seq_slots[0])
    if active.all() and (seq_slots == first).all():
        return LoRAStep(first)
    token_slots = np.repeat(seq_slots, query_lens)
    rows = np.flatnonzero(token_slots >= 0)
    order = np.argsort(token_slots[rows], kind="stable")
    perm = rows[order]
    slots = token_slots[perm]
    bounds = np.flatnonzero(np.diff(slots)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [len(perm)]))
    groups = tuple((int(slots[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True))
    return LoRAStep(-1, torch.from_numpy(perm).to(device), groups)
