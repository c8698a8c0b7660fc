"""Which projections of a loaded model take LoRA, and what a PEFT module name maps onto.

Targets are the attention's q/k/v/o and the dense MLP's gate/up/down projections, in every
family: our fused ``qkv_proj`` and ``gate_up_proj`` hold one LoRA *slice* per HF projection
stacked into them (``CausalLM.stacked_params``), in that order; a family whose checkpoint fuses
them itself (Phi-3) has one slice for the whole fused projection, as its PEFT adapters target
it. Expert MLPs (and Qwen2-MoE's shared expert), embeddings and the LM head are not targets.

Every size here is the full model's; a tensor-parallel rank takes its part of an adapter with
the projection's own ``checkpoint_range`` (B's rows for column-parallel layers, A's columns
for row-parallel ones), as it took its part of the base weight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.engine.models.layers import CausalLM, Linear

# Our module paths that take LoRA (a Mixtral/Qwen-MoE sparse layer's ``mlp`` has no
# gate_up_proj of its own, so only its attention matches).
_TARGET = re.compile(r"^model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|"
                     r"down_proj))$")
# Module names PEFT gives embeddings and LM heads: refused by name.
EMBEDDING_NAMES = frozenset({"embed_tokens", "lm_head", "wte", "word_embeddings"})


@dataclass(frozen=True, slots=True)
class TargetSlice:
    """Where one PEFT module goes: slice ``index`` of the projection ``module`` (our path),
    whose output rows in the full model are ``[row_start, row_start + rows)``."""

    module: str
    index: int
    row_start: int
    rows: int
    in_features: int


class LoRATargets:
    """The model's LoRA-capable projections and the PEFT module names that reach them."""

    def __init__(self, model: CausalLM) -> None:
        self.modules: dict[str, Linear] = {}
        self.slices: dict[str, TargetSlice] = {}  # PEFT module name -> its slice
        self.num_slices: dict[str, int] = {}  # our module path -> how many slices it has
        stacked = model.stacked_params()
        for path, module in model.named_modules():
            if not isinstance(module, Linear) or not _TARGET.match(path):
                continue
            self.modules[path] = module
            parent, _, short = path.rpartition(".")
            sources = stacked.get(short, (short,))
            fused = len(sources) == 1  # the whole projection is one slice
            in_full = _full_in(module)
            row = 0
            for i, source in enumerate(sources):
                rows = sum(_full_rows(module, j) for j in range(len(module.shard_sizes))) \
                    if fused else _full_rows(module, i)
                # Every family keeps its checkpoint's attention and dense-MLP names.
                self.slices[f"{parent}.{source}"] = TargetSlice(path, i, row, rows, in_full)
                row += rows
            self.num_slices[path] = len(sources)
        self.short_names = frozenset(name.rpartition(".")[2] for name in self.slices)

    def lookup(self, peft_module: str) -> TargetSlice | None:
        return self.slices.get(peft_module)


def _full_rows(module: Linear, index: int) -> int:
    shard = module.checkpoint_range("weight", index) if hasattr(module, "checkpoint_range") \
        else None
    if shard is None or shard.dim != 0:
        return module.shard_sizes[index]
    return shard.full


def _full_in(module: Linear) -> int:
    local = module.in_features
    shard = module.checkpoint_range("weight", 0) if hasattr(module, "checkpoint_range") \
        else None
    return shard.full if shard is not None and shard.dim == 1 else local
