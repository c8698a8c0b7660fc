"""Speculative decoding as a step feature the runner builds without naming it: this module
registers its maker with ``features.registry``, and the factory it makes owns everything the
runner once did for it. Before the KV pool is sized: the logits rows a sequence may take (its
token and the ``k`` drafts verified), the draft model's KV per token (its own cache under the
target's block ids, so the pool is sized for both) and the memory its weights and
distributions will take. After: the draft model itself (rank 0), the verifier that owns it
(``verifier``) and the proposers it runs before each schedule (``proposers``).
"""

from __future__ import annotations

import os

from services.engine.config import SpecMethod, SpeculativeConfig
from services.engine.features import registry
from services.engine.features.protocol import FeatureFactory
from services.engine.memory_budget import F32, weight_bytes
from services.engine.model_runner import ModelRunner
from services.engine.spec_decode import draft_model
from services.engine.spec_decode.draft_model import DraftModel
from services.engine.spec_decode.proposers import Speculator
from services.engine.spec_decode.verifier import Verifier
from services.engine.step_buffers import StepBuffers

# The draft model's pinned staging on a GPU (see ``_staging``): on only when set to 1.
DRAFT_STAGING_ENV = "PAGODA_DRAFT_STAGING"


def draft_probs_bytes(rows: int, num_drafts: int, vocab: int) -> int:
    """The draft's distributions [rows, k, vocab] float32 and one row of race noise per pass."""
    return rows * num_drafts * vocab * F32 + rows * vocab * F32


class SpeculationFactory(FeatureFactory):
    """The feature ``speculation`` on one rank, before and after the KV pool."""

    name = Verifier.name

    def __init__(self, runner: ModelRunner, spec: SpeculativeConfig) -> None:
        self.spec = spec
        self.dtype = runner.dtype
        self.max_rows = runner.config.max_num_seqs
        self.vocab = runner.model_config.vocab_size
        # Rank 0's draft model (method draft_model), if any: it runs unsharded there.
        self.draft_path = (spec.model if spec.method is SpecMethod.DRAFT_MODEL
                           and runner.tp.rank == 0 else None)

    def lookahead_rows(self) -> int:
        return self.spec.num_speculative_tokens

    def kv_bytes_per_token(self) -> int:
        if self.draft_path is None:
            return 0
        return draft_model.kv_bytes_per_token(self.draft_path, self.dtype)

    def held_bytes(self) -> dict[str, int]:
        """The draft model's weights (loaded after the pool) and its distributions."""
        if self.draft_path is None:
            return {}
        k = self.spec.num_speculative_tokens
        return {"draft_weights": weight_bytes(self.draft_path, self.dtype),
                "draft_probs": draft_probs_bytes(self.max_rows, k, self.vocab)}

    def build(self, runner: ModelRunner) -> Verifier:
        """Rank 0, after the KV pool: the draft model (its KV in the pool's block ids), the
        verifier that owns it, and its proposers."""
        c = runner.config
        max_len = c.max_model_len or runner.model_config.max_position_embeddings
        draft = None if self.draft_path is None else DraftModel(
            self.draft_path, runner.dtype, runner.device, runner.attn_backend,
            runner.num_blocks, runner.block_size, max_len, _staging(runner, max_len))
        verifier = Verifier(self.spec, c.max_num_seqs, runner.device, draft,
                            runner.grammar_masks)
        verifier.proposers = Speculator(self.spec, max_len, verifier)
        return verifier


def _staging(runner: ModelRunner, max_len: int) -> StepBuffers | None:
    """The draft's passes cross in pinned buffers of their own on a GPU (one copy each; first
    run on an H200 on 2026-12-04, the model as its own draft: equal tokens, every draft
    accepted). ``PAGODA_DRAFT_STAGING=0`` gives the passes the pageable copies instead."""
    if runner.device.type != "cuda" or os.environ.get(DRAFT_STAGING_ENV, "1") == "0":
        return None
    c = runner.config
    width = min(-(-max_len // runner.block_size), runner.num_blocks)
    return StepBuffers(c.max_num_batched_tokens, c.max_num_seqs, width, runner.block_size,
                       runner.device)


def _make(runner: ModelRunner) -> SpeculationFactory | None:
    spec = runner.config.speculative_config
    return None if spec is None else SpeculationFactory(runner, spec)


registry.register(Verifier.name, _make)
