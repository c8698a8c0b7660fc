"""OpenAI's ``logit_bias``: per request, token id -> a number added to its logit before sampling.

Each request's bias is turned into two small device tensors once, when it enters the engine
(``LogitBias.build``); each step adds every biased row's entries to the logits in one
``index_put`` (no Python loop over tokens). Raw logprobs are taken before it, as vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.protocol.wire import BadRequest


@dataclass(frozen=True, slots=True)
class LogitBias:
    token_ids: torch.Tensor  # int64 [k]
    values: torch.Tensor  # float32 [k]

    @classmethod
    def build(cls, bias: dict[int, float] | None, device: torch.device) -> LogitBias | None:
        if not bias:
            return None
        ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
        return cls(ids, values)


def check_logit_bias(bias: dict[int, float] | None, vocab_size: int) -> None:
    """A 400 (``BadRequest`` naming ``logit_bias``) for a token id past the vocabulary."""
    if bias and max(bias) >= vocab_size:
        raise BadRequest(
            f"logit_bias token id {max(bias)} is out of range for the vocabulary "
            f"({vocab_size} tokens)",
            "logit_bias",
        )


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[LogitBias | None]) -> torch.Tensor:
    """``logits[i, t] += bias`` for every row's entries; a new tensor when any row has a bias,
    else ``logits`` itself. ``biases`` has one entry per row of ``logits``."""
    rows = [i for i, b in enumerate(biases) if b is not None]
    if not rows:
        return logits
    device = logits.device
    ids = torch.cat([biases[i].token_ids for i in rows])
    values = torch.cat([biases[i].values for i in rows])
    counts = torch.tensor([len(biases[i].token_ids) for i in rows], device=device)
    owner = torch.repeat_interleave(torch.tensor(rows, device=device), counts)
    return logits.index_put((owner, ids), values.to(logits.dtype), accumulate=True)
