"""The draft model of method ``draft_model``: a smaller model of the target's tokenizer, served
inside the same engine, that proposes ``k`` tokens per request each step.

Memory: its KV cache has one block per block of the target's pool, under the same block ids,
so a request's block table (and the prefix cache, and the block manager's accounting) covers
both models; the pool's size is computed from the two models' bytes per token together
(``kv_bytes_per_token``), within the one KV budget.

Each step, on the step thread, before the target's forward pass (``propose``):

    pass 1     the tokens the draft has not seen yet, of every request in the step (``D .. E``:
               the prompt chunk the target computes, or after a decode the last token and the
               accepted drafts it did not compute); logits at each drafting request's last one
               give draft 1
    pass j     (j = 2 .. k) draft j-1 of each request still drafting, one token each, at the
               next position; its logits give draft j

A drafting request's draft j-1 is written into the slot of position ``L + j - 2`` (``L``: its
known tokens), which the scheduler allocated for the target's verification of it; if the target
rejects it, the next step's pass 1 overwrites it. The draft model samples its drafts from its
own distribution at the request's temperature (greedy requests take the argmax), and returns
those distributions (``q``) for the rejection sampler.

Everything a pass needs but the draft tokens themselves is planned on the engine thread as host
arrays (``DraftInputs``, from the step's gathered block tables); the step thread puts each pass
on the device just before running it: on a GPU through the draft's own ``StepBuffers`` (one
pinned buffer, one ``non_blocking`` copy per pass, instead of six pageable copies on the engine
thread), on the CPU as views of the arrays. The draft tokens stay on the device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from services.engine.attention.base import AttentionBackend, AttentionMetadata
from services.engine.attention.contract import check_kv_caches, check_step
from services.engine.attention.metadata import build_attention_metadata, plan_step, to_metadata
from services.engine.models.config import ModelConfig
from services.engine.models.loader import load_model
from services.engine.models.onednn import FULL_PASS_ROWS, ROW_BUCKETS, warm_up_products
from services.engine.parallel.group import SINGLE, building

logger = logging.getLogger(__name__)


class PassStaging(Protocol):
    """Where a pass's inputs cross to the device in one copy: the core's ``StepBuffers``
    (``feature`` builds them; named here by the shape the passes use)."""

    def fits(self, num_tokens: int, num_seqs: int, width: int) -> bool: ...

    def stage(self, input_ids: np.ndarray, block_tables: np.ndarray, num_blocks: np.ndarray,
              seq_lens: np.ndarray, query_lens: np.ndarray, logits_rows: np.ndarray) -> Any:
        """Returns the staged step: ``input_ids``, ``positions``, ``meta``, ``logits_rows``."""


@dataclass(slots=True)
class DraftPass:
    """One forward pass of the draft model, as host arrays (``metadata.plan_step``'s
    arguments); ``DraftModel.on_device`` makes its tensors on the step thread."""

    block_tables: np.ndarray
    num_blocks: np.ndarray
    seq_lens: np.ndarray
    query_lens: np.ndarray
    token_ids: np.ndarray | None  # pass 1: the catch-up tokens; later: the previous drafts
    # pass 1: hidden rows whose logits propose draft 1 (one per drafting request); later
    # passes: which drafting requests (indices) take part, each one row
    rows: np.ndarray


@dataclass(slots=True)
class DevicePass:
    """A ``DraftPass`` on the device (valid until the next pass is put there)."""

    input_ids: torch.Tensor | None
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: torch.Tensor


@dataclass(slots=True)
class DraftInputs:
    """A step's draft passes and the drafting requests' sampling parameters (gathered)."""

    passes: list[DraftPass]  # empty when the step has nothing for the draft to see
    num_drafts: np.ndarray  # [Rd] int64: drafts each drafting request proposes
    greedy: np.ndarray  # [Rd] bool
    temperature: np.ndarray  # [Rd] float32 (1 on greedy rows)
    generators: list[torch.Generator | None] | None  # [Rd] seeded rows' own; None: none


def kv_bytes_per_token(path: str | Path, dtype: torch.dtype) -> int:
    """Bytes of the draft's KV cache one token occupies (all its layers)."""
    return ModelConfig.from_hf_dir(path).kv_bytes_per_token(dtype)


class DraftModel:
    def __init__(self, path: str, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, num_blocks: int, block_size: int,
                 max_model_len: int, staging: PassStaging | None = None) -> None:
        """``staging``: the pinned buffers the passes cross in (a GPU's; None: the CPU's
        views of the host arrays)."""
        config = ModelConfig.from_hf_dir(path)
        if config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft's context ({config.max_position_embeddings}"
                f" tokens) is shorter than the engine's max_model_len ({max_model_len}); pass "
                "--max-model-len")
        with building(SINGLE):  # unsharded, whatever the target's tensor parallelism
            self.model = load_model(path, dtype, device, backend)
        self.model.limit_context(max_model_len)
        if device.type == "cpu":
            self.model.pack_weights()
        self.config = self.model.config
        self.device = device
        self.block_size = block_size
        self.staging = staging
        mc = self.config
        self.kv_caches = [
            backend.allocate_kv_cache(num_blocks, block_size, mc.num_kv_heads, mc.head_dim, dtype,
                                      device)
            for _ in range(mc.num_layers)
        ]
        check_kv_caches(self.kv_caches, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                        head_dim=mc.head_dim, dtype=dtype)

    # -- the step thread --------------------------------------------------------------------

    def on_device(self, p: DraftPass) -> DevicePass:
        """The pass's tensors: staged in one pinned copy (``staging``), else (the CPU, or a
        pass too big for the buffers) made from the host arrays."""
        num_tokens = int(p.query_lens.sum())
        if self.staging is not None and self.staging.fits(num_tokens, len(p.seq_lens),
                                                          p.block_tables.shape[1]):
            ids = p.token_ids if p.token_ids is not None else np.zeros(num_tokens, np.int64)
            staged = self.staging.stage(ids, p.block_tables, p.num_blocks, p.seq_lens,
                                        p.query_lens, p.rows)
            check_step(staged.meta, num_tokens, self.kv_caches[0][0])
            return DevicePass(None if p.token_ids is None else staged.input_ids,
                              staged.positions, staged.meta, staged.logits_rows)
        step = plan_step(p.block_tables, p.num_blocks, p.seq_lens, p.query_lens,
                         self.block_size)
        meta, positions = to_metadata(step, self.block_size, self.device)
        check_step(meta, num_tokens, self.kv_caches[0][0])
        ids = None if p.token_ids is None else torch.from_numpy(p.token_ids).to(self.device)
        return DevicePass(ids, positions, meta, torch.from_numpy(p.rows).to(self.device))

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the passes; returns the drafts ``[Rd, K]`` (padding past each request's count)
        and, unless every drafting request is greedy, the distributions they were drawn from
        ``[Rd, K, V]``."""
        num = len(inputs.num_drafts)
        width = int(inputs.num_drafts.max(initial=0))
        drafts = torch.zeros((num, width), dtype=torch.long, device=self.device)
        probs = None
        if not inputs.passes:
            return drafts, probs
        first = self.on_device(inputs.passes[0])
        hidden = self._forward(first.input_ids, first)
        if not num:
            return drafts, probs
        all_greedy = bool(inputs.greedy.all())
        if not all_greedy:
            probs = torch.zeros((num, width, self.config.vocab_size), device=self.device)
        rows = torch.arange(num, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, first.rows))
        for j in range(width):
            if j:
                p = self.on_device(inputs.passes[j])
                rows = p.rows
                logits = self.model.compute_logits(
                    self._forward(drafts[rows, j - 1], p))
            token, q = self._draw(logits, inputs, rows.tolist(), all_greedy)
            drafts[rows, j] = token
            if probs is not None:
                probs[rows, j] = q
        return drafts, probs

    def _forward(self, input_ids: torch.Tensor, p: DevicePass) -> torch.Tensor:
        self.model.plan_attention(p.meta)
        return self.model(input_ids, p.positions, self.kv_caches, p.meta)

    def _draw(self, logits: torch.Tensor, inputs: DraftInputs, rows: list[int],
              all_greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens for ``rows`` from their logits: argmax for greedy requests, else a draw
        from ``softmax(logits / T)`` (an exponential race; seeded requests from their own
        generators), and that distribution."""
        argmax = logits.argmax(-1)
        if all_greedy:
            return argmax, None
        t = torch.from_numpy(inputs.temperature[rows]).to(self.device).unsqueeze(1)
        q = torch.softmax(logits / t, dim=-1)
        race = torch.empty_like(q).exponential_()
        gens = inputs.generators
        if gens is not None:
            for i, r in enumerate(rows):
                if gens[r] is not None and not inputs.greedy[r]:
                    race[i].exponential_(generator=gens[r])
        token = (q / race).argmax(-1)
        greedy = torch.from_numpy(inputs.greedy[rows]).to(self.device)
        return torch.where(greedy, argmax, token), q

    @torch.inference_mode()
    def warm_up(self, max_tokens: int, max_rows: int, room: int) -> None:
        """As the target's warm-up (``ModelRunner._warm_up``): one pass per GEMM row bucket,
        and the LM head over as many rows, so oneDNN builds its primitives now. Writes only
        into the first KV blocks, which hold nothing yet."""
        start = time.perf_counter()
        for n in (b for b in ROW_BUCKETS if b <= min(room, max_tokens)):
            if n > FULL_PASS_ROWS:
                warm_up_products(self.model, n)
                continue
            table = list(range(-(-n // self.block_size)))
            meta, positions = build_attention_metadata([table], [n], [n], self.block_size,
                                                       self.device)
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            hidden = self._forward(ids, DevicePass(None, positions, meta, ids))
            if n <= max_rows:
                self.model.compute_logits(hidden)
        logger.info("draft model warmed up in %.1fs", time.perf_counter() - start)
