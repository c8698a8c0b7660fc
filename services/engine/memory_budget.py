"""The memory the KV pool must leave to the engine's features, held back before it is sized.

vLLM sizes its KV cache after a profiling run: a dummy forward at the largest batch, the
sampler at the most rows, every feature on; what that run needed is held back and the pool
gets the rest. Here the same items are counted from their shapes, once, before the pool is
allocated (``FeatureMemory``):

    activations   the largest step (max_num_batched_tokens): hidden states, this rank's
                  q/k/v, MLP rows and the attention output, in the model's dtype
    sampler       the largest batch's logits rows (max_num_seqs, times the rows a sequence
                  may take: 1 and the features' lookahead rows) of the whole vocabulary,
                  float32, times the copies one step can hold at once (``SAMPLER_COPIES``)
    held          the step features built before the pool, by feature (``held_bytes``:
                  an adapter feature's slots, every slot of every adapted projection)
    reserved      the step features built after it, by item (``FeatureFactory.held_bytes``:
                  a feature's own model and buffers, loaded once the pool exists)
    step peak     with ``PAGODA_PROFILE_RUN=1``: the largest step's peak, measured by the
                  profiling run (``profile_run``), in place of activations and sampler

With no explicit ``kv_cache_memory`` the pool's budget is the engine's memory (2 GiB on the
CPU, 85% of free memory on a GPU) less these; an explicit ``kv_cache_memory`` is the pool's
own size, as vLLM's ``kv_cache_memory_bytes``. On a GPU what the features built before the
pool hold already left the free memory the budget is read from, so it is not counted twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from services.engine.models.config import ModelConfig

# float32 [rows, vocab] one sampling step can hold at once: the logits, the adjusted copy
# (bias, bans, penalties), the scaled and truncated one, and the noise (torch's path) or the
# log-softmax of logprobs rows.
SAMPLER_COPIES = 4
# The largest step's rows, in hidden-size units besides q/k/v and the MLP: the residual, the
# normed input, the attention output and the projection's output.
_HIDDEN_COPIES = 4
F32 = 4


@dataclass(frozen=True, slots=True)
class FeatureMemory:
    """Bytes held back from the KV pool's budget, by item (an item absent, or 0: its
    feature is off)."""

    activations: int = 0
    sampler: int = 0
    held: Mapping[str, int] = field(default_factory=dict)  # features built before the pool
    reserved: Mapping[str, int] = field(default_factory=dict)  # features built after it
    step_peak: int = 0  # measured (``profile_run``): in place of activations and sampler

    def __post_init__(self) -> None:
        items = [self.activations, self.sampler, self.step_peak, *self.held.values(),
                 *self.reserved.values()]
        assert all(n >= 0 for n in items), self

    def item(self, name: str) -> int:
        """One item's bytes: ``activations``, ``sampler``, a feature's name (``held``) or a
        factory's item (``reserved``); 0 when absent."""
        if name in ("activations", "sampler", "step_peak"):
            return getattr(self, name)
        return self.held.get(name, 0) + self.reserved.get(name, 0)

    def total(self, device: torch.device) -> int:
        """What comes off the budget on ``device`` (a GPU's free memory already lacks what
        the features built before the pool hold)."""
        held = 0 if device.type == "cuda" else sum(self.held.values())
        step = self.step_peak or self.activations + self.sampler
        return step + sum(self.reserved.values()) + held


def activation_bytes(mc: ModelConfig, tokens: int, tp_size: int, dtype: torch.dtype) -> int:
    """The largest step's rows in flight through one layer, on one rank."""
    element = torch.empty((), dtype=dtype).element_size()
    qkv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim // tp_size
    mlp = 3 * mc.intermediate_size // tp_size  # gate and up, then their product
    return tokens * (_HIDDEN_COPIES * mc.hidden_size + qkv + mlp) * element


def sampler_bytes(rows: int, vocab: int) -> int:
    return rows * vocab * F32 * SAMPLER_COPIES


def weight_bytes(path: str | Path, dtype: torch.dtype) -> int:
    """A checkpoint's parameters in ``dtype``, from the safetensors headers (nothing loaded)."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 -- safe_open is not a dict
                shape = f.get_slice(name).get_shape()
                total += int(torch.Size(shape).numel()) * element
    return total
