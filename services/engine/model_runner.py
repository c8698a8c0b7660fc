"""Tensors in, tokens out: flattens a scheduled step into one batch, runs the model, samples."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from services.engine import cpu_threads
from services.engine.attention.contract import check_kv_caches, check_step
from services.engine.attention.metadata import build_attention_metadata
from services.engine.attention.selector import get_attention_backend
from services.engine.config import EngineConfig
from services.engine.models.loader import load_model
from services.engine.models.onednn import ROW_BUCKETS
from services.engine.sampler import Sampler, SamplerOutput, SamplingRequest
from services.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 * 1024**3
_GPU_MEMORY_FRACTION = 0.85


@dataclass(slots=True)
class StepResult:
    """Sampled tokens, one per scheduled request that completes its sequence this step, in
    schedule order (what ``Scheduler.update`` takes)."""

    sampler_output: SamplerOutput


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        if self.device.type == "cpu":
            cpu_threads.configure(config.cpu_threads)  # once, before the first GEMM
        self.attn_backend = get_attention_backend(self.device, config.attention_backend)
        self.model = load_model(model_path, self.dtype, self.device, self.attn_backend)
        if self.device.type == "cpu":
            self.model.pack_weights()  # oneDNN's layout, once (see models.onednn)
        self.model_config = self.model.config
        self.block_size = config.block_size
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self.sampler = Sampler()
        if self.device.type == "cpu":
            self._warm_up()
        logger.info(
            "model loaded: arch=%s dtype=%s device=%s backend=%s kv_blocks=%d (%d tokens)",
            self.model_config.architecture,
            self.dtype,
            self.device,
            self.attn_backend.name,
            self.num_blocks,
            self.num_blocks * self.block_size,
        )

    # -- KV cache ---------------------------------------------------------------------------

    def _decide_num_blocks(self) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        bytes_per_block = self.model_config.kv_bytes_per_token(self.dtype) * self.block_size
        budget = self.config.kv_cache_memory
        if budget is None:
            budget = self._default_kv_budget()
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds no block of {bytes_per_block} bytes"
            )
        return int(num_blocks)

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return _DEFAULT_CPU_KV_BYTES
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free * _GPU_MEMORY_FRACTION)

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mc = self.model_config
        caches = [
            self.attn_backend.allocate_kv_cache(
                num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
            )
            for _ in range(mc.num_layers)
        ]
        # The caches' half of the attention contract, once (no layer checks it again).
        check_kv_caches(
            caches,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=self.dtype,
        )
        return caches

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One forward pass per GEMM row bucket (``onednn.ROW_BUCKETS``), and the LM head over
        as many rows: oneDNN builds a primitive the first time it meets a row count, some
        milliseconds each, which would otherwise land on a new engine's first requests (its
        first TTFTs were 3x its later ones). It writes into the first KV blocks only, which
        hold nothing yet."""
        start = time.perf_counter()
        room = self.num_blocks * self.block_size
        for n in (b for b in ROW_BUCKETS if b <= min(room, self.config.max_num_batched_tokens)):
            table = list(range(-(-n // self.block_size)))
            meta, positions = build_attention_metadata([table], [n], [n], self.block_size,
                                                       self.device)
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            hidden = self.model(ids, positions, self.kv_caches, meta)
            if n <= self.config.max_num_seqs:
                self.model.compute_logits(hidden)
        logger.info("warmed up in %.1fs", time.perf_counter() - start)

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        input_ids: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        block_tables: list[list[int]] = []
        for s in sched.scheduled:
            start = s.request.num_computed_tokens
            input_ids.extend(s.request.token_ids[start : start + s.num_new_tokens])
            seq_lens.append(start + s.num_new_tokens)
            query_lens.append(s.num_new_tokens)
            block_tables.append(s.block_table)
        meta, positions = build_attention_metadata(
            block_tables, seq_lens, query_lens, self.block_size, self.device
        )
        check_step(meta, len(input_ids), self.kv_caches[0][0])  # once per step, not per layer
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, positions, self.kv_caches, meta)

        # Logits only where a token is sampled: the last new token of completed sequences.
        rows = [i for i, s in enumerate(sched.scheduled) if s.completes_sequence]
        if not rows:
            return StepResult(SamplerOutput(token_ids=[], logprobs=[]))
        ends = meta.cu_seqlens_q[1:].to(torch.long) - 1
        last = ends[torch.tensor(rows, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(hidden.index_select(0, last))
        reqs = [sched.scheduled[i].request for i in rows]
        sampling_rows = [
            SamplingRequest(
                params=r.params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=r.generator,
                eos_token_ids=r.eos_token_ids,
            )
            for r in reqs
        ]
        return StepResult(self.sampler(logits, sampling_rows))
