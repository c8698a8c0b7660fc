"""The rejection sampler's arithmetic (Leviathan et al., arXiv 2211.17192; vLLM's
``RejectionSampler``), on padded ``[rows, k]`` tensors, no model and no request.

Row i drafted ``d_1 .. d_k`` (``k = num_drafts[i]``, padding past it) from distributions
``q_1 .. q_k`` (one-hot when the drafts came from a lookup, not a model), and the target scored
``k + 1`` positions: ``p_1 .. p_k`` verify the drafts, ``p_{k+1}`` follows the last. Draft j is
accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; the first rejected one is replaced by
a token drawn from ``norm(max(0, p_j - q_j))``, and when all are accepted the row also gets a
token drawn from ``p_{k+1}`` (the bonus). Every emitted token is then distributed exactly as
the target's own sampling would have it, whatever q was: q only decides how many come per step.
A greedy row accepts while the draft equals the target's argmax (the limit of the rule as the
temperature goes to 0), so its output is the target's greedy output.

Drawing the replacement and the bonus token is left to the caller's sampler (one Gumbel-max
over one row per request), so a row without drafts draws its token exactly as it would in a
step without speculation.
"""

from __future__ import annotations

import torch


def padded(flat: torch.Tensor, num_drafts: torch.Tensor, width: int,
           fill: float | int = 0) -> torch.Tensor:
    """``[D, ...]`` values of every row's drafts (row-major) as ``[R, width, ...]``."""
    rows = len(num_drafts)
    out = flat.new_full((rows, width, *flat.shape[1:]), fill)
    if flat.shape[0]:
        out[draft_mask(num_drafts, width)] = flat
    return out


def draft_mask(num_drafts: torch.Tensor, width: int) -> torch.Tensor:
    """``[R, width]`` bool: which padded slots hold a draft."""
    return torch.arange(width, device=num_drafts.device) < num_drafts.unsqueeze(1)


def accepted_counts(accept: torch.Tensor) -> torch.Tensor:
    """``[R]``: how many leading drafts of each row are accepted (``accept``: ``[R, K]`` bool,
    False on padding)."""
    if accept.shape[1] == 0:
        return accept.new_zeros(accept.shape[0], dtype=torch.long)
    return accept.long().cumprod(1).sum(1)


def accept_sampled(p_draft: torch.Tensor, q_draft: torch.Tensor | None,
                   uniforms: torch.Tensor) -> torch.Tensor:
    """``u < p(d) / q(d)`` as ``u * q(d) < p(d)`` (``q`` None: one-hot, q(d) = 1). Strict, so a
    token the target gives probability 0 is never accepted."""
    if q_draft is None:
        return uniforms < p_draft
    return uniforms * q_draft < p_draft


def residual(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` per row (unnormalised: the caller samples in proportion to it), q the
    rejected draft's distribution, one-hot at ``draft`` when None. A row whose residual has no
    mass (p = q up to rounding, where a rejection cannot really happen) keeps p."""
    if q is None:
        out = p.scatter(1, draft.unsqueeze(1), 0.0)
    else:
        out = (p - q).clamp_min_(0.0)
    empty = out.sum(1, keepdim=True) <= 0
    return torch.where(empty, p, out)
