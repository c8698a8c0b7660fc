"""Tensors in, tokens out: flattens a scheduled step into one batch, runs the model, samples.

On a GPU a step's integer inputs cross in one pinned, non-blocking copy (``step_buffers``),
decode steps replay a CUDA graph of their batch-size bucket (``cuda_graphs``), and the sampled
token ids are the one tensor that comes back. Every kernel variant the engine can meet is
compiled (and every graph captured) before the runner exists, so a new engine's first requests
run at full speed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from operator import getitem
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.version import package_version
from services.engine import (
    cpu_threads,
    memory_budget,
    pp_stage,
    profile_run,
    prompt_logprobs,
    shard_sampling,
)
from services.engine.attention.base import AttentionMetadata
from services.engine.attention.contract import check_kv_caches, check_step
from services.engine.attention.metadata import (
    build_attention_metadata,
    pack_tables,
    plan_step,
    to_metadata,
)
from services.engine.attention.selector import get_attention_backend
from services.engine.config import EngineConfig
from services.engine.cuda_graphs import DecodeGraphs, capture_sizes
from services.engine.decode_batch import DecodeBatch
from services.engine.feature_warm_up import warm_up_features, warm_up_forward
from services.engine.features import registry
from services.engine.features.protocol import FeatureFactory
from services.engine.input_batch import InputBatch
from services.engine.models.config import ModelConfig
from services.engine.models.loader import load_model
from services.engine.models.onednn import FULL_PASS_ROWS, ROW_BUCKETS, warm_up_products
from services.engine.models.partition import check_sizes, local_kv_heads
from services.engine.models.pipeline_stage import (
    IntermediateTensors,
    PipelineStage,
    warm_up_input,
)
from services.engine.models.weights_digest import weights_digest
from services.engine.parallel.group import SINGLE, TPGroup, building
from services.engine.parallel.node_group import NodeGroup
from services.engine.parallel.pipeline import StageLink
from services.engine.parallel.step_broadcast import StepBatch, send_step
from services.engine.parallel.workers import WorkerGroup
from services.engine.request import Request
from services.engine.sampler import Sampler, SamplerOutput
from services.engine.sampling_batch import SamplingBatch, SamplingRequest
from services.engine.scheduler import SchedulerOutput
from services.engine.step_buffers import StagedStep, StepBuffers
from services.engine.step_features import StepFeatures, StepRows
from services.engine.structured.manager import GrammarManager
from services.engine.structured.masks import TokenMasker
from services.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 * 1024**3
_GPU_MEMORY_FRACTION = 0.85
# The other ranks' entry, run as ``python -m``: builds their shard with this runner.
TP_WORKER_MODULE = "services.engine.tp_worker"
# Set to 1, a CPU engine starts without its warm-up passes (as vLLM's VLLM_SKIP_WARMUP on
# Gaudi): its first requests pay what the warm-up would have (oneDNN building its primitives).
# For tests and development, where engines start far more often than they serve.
SKIP_WARM_UP_ENV = "PAGODA_SKIP_WARMUP"
# Flags a worker node may set differently from its leader (its own place, its own cores), and
# those the identity names by what they resolve to (the model's name, the dtype).
_NOT_COMPARED_FLAGS = frozenset({"model", "node_rank", "cpu_threads", "device", "master_addr",
                                 "served_model_name", "dtype"})


def node_group(config: EngineConfig) -> NodeGroup | None:
    """The engine's node group when its ranks span pods; None in one pod."""
    if config.nnodes == 1:
        return None
    return NodeGroup(config.nnodes, config.node_rank, config.master_addr, config.master_port,
                     config.ranks_per_node)


def group_identity(config: EngineConfig, model_path: str) -> dict[str, str]:
    """What every node of a group must share to be admitted (``parallel.node_join``): the
    model's name and weights, the dtype, Pagoda's version and every engine flag but the
    per-node ones, each by name so a refusal names the difference."""
    identity = {
        "model": config.served_model_name or Path(model_path).name,
        "weights digest": weights_digest(model_path),
        "dtype": str(config.torch_dtype()).removeprefix("torch."),
        "pagoda version": package_version(),
    }
    for f in dataclasses.fields(config):
        if f.name not in _NOT_COMPARED_FLAGS:
            identity["--" + f.name.replace("_", "-")] = repr(getattr(config, f.name))
    return identity


@dataclass(slots=True)
class CpuInputs:
    """A CPU step's tensors, built by ``prepare`` (on the host thread, under async scheduling)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor | None  # hidden rows that get logits; None: every row
    features: dict = field(default_factory=dict)  # each feature's ``host_inputs``


@dataclass(slots=True)
class PreparedStep:
    """A step ready to run: what ``ModelRunner.prepare`` built from its ``SchedulerOutput``."""

    batch: StepBatch
    sampling: SamplingBatch  # the sampled rows' parameters, gathered (the step owns them)
    state: dict  # each step feature's own state for this step (``StepFeature.prepare_rows``)
    # (positions in the input ids, rows of the in-flight step's sampled ids) of placeholders
    fill: tuple[torch.Tensor, torch.Tensor] | None
    cpu_inputs: CpuInputs | None


@dataclass(slots=True)
class StepResult:
    """Sampled tokens, one per scheduled request that completes its sequence this step, in
    schedule order (what ``Scheduler.update`` takes)."""

    sampler_output: SamplerOutput
    # (the request's place in the schedule, its prompt positions scored this step): only for
    # prompt_logprobs requests
    prompt_logprobs: list = field(default_factory=list)
    # A step whose feature sampled it (``StepFeature.sample``) and emits runs: per sampled
    # request its tokens (``runs``) and their logprobs (``logprobs``), which the scheduler
    # and the engine apply; None: one token each, as ``sampler_output``.
    spec: Any = None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, tp: TPGroup | None = None,
                 pipeline: StageLink | None = None) -> None:
        """``tp``: this rank's group in a tensor-parallel worker. Without it, a runner with
        ``tensor_parallel_size`` > 1 is rank 0: it starts the other ranks (``parallel.workers``)
        and sends them every step; only rank 0 samples. ``pipeline``: a pipeline stage's link
        (``pp_stage``; rank 0 joins its own below)."""
        self.workers: WorkerGroup | None = None
        self.pipeline = pipeline
        if tp is None and config.node_rank != 0:
            raise ValueError(f"node_rank={config.node_rank}: a worker node joins its leader "
                             "through `python -m services.engine.serving.server` (it serves "
                             "no requests itself)")
        if tp is None and config.world_size > 1:
            # before anything starts: a model whose heads do not split is an error at once
            check_sizes(ModelConfig.from_hf_dir(model_path), config.tensor_parallel_size)
            if config.pipeline_parallel_size > 1:
                pp_stage.check_layers(config, model_path)
            nodes = node_group(config)
            identity = None if nodes is None else group_identity(config, model_path)
            self.workers = WorkerGroup(TP_WORKER_MODULE, config.world_size,
                                       config.torch_device(), (config, model_path), nodes,
                                       identity)
            tp, config = self.workers.tp, replace(config, device=str(self.workers.device))
            if config.pipeline_parallel_size > 1:
                self.pipeline, tp = pp_stage.join(tp, config, model_path)
        self.stage: PipelineStage | None = None if self.pipeline is None else (
            pp_stage.stage_of_rank(self.pipeline, model_path))
        self.tp = tp or SINGLE
        # What the KV budget left to the features (None: kv_cache_memory or num_blocks given).
        self.feature_memory: memory_budget.FeatureMemory | None = None
        # Tensor parallelism: sample on the vocabulary shards where a step allows it
        # (``shard_sampling``); False gathers every step's logits on rank 0, as before.
        self.sample_on_shards = True
        try:
            self._load(config, model_path)
        except BaseException:
            if self.workers is not None:  # they wait in a collective rank 0 will never join
                self.workers.kill()
            raise

    def _load(self, config: EngineConfig, model_path: str) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        if self.device.type == "cpu":
            # once, before the first GEMM; each rank takes its share of the cores
            cpu_threads.configure(config.cpu_threads, config.ranks_per_node)
        self.attn_backend = get_attention_backend(self.device, config.attention_backend,
                                                  self.dtype)
        with building(self.tp):
            self.model = load_model(model_path, self.dtype, self.device, self.attn_backend,
                                    config.quantization, self.stage)
        if config.max_model_len is not None:
            self.model.limit_context(config.max_model_len)
        self.model_config = self.model.config
        # (decode batch, the input batch's layout) -> its requests' rows
        self._rows_of_batch: tuple[tuple[DecodeBatch, int], np.ndarray] | None = None
        # The step's optional features, in the order the runner calls them (``step_features``),
        # made by the enabled ones' factories (``features.registry``): first those that change
        # the model's layers, before packing (they read the weights' shapes); the others after
        # the KV pool, their factories saying until then what they need of its budget and of
        # every step's logits rows.
        self.features = StepFeatures()
        self.factories: list[FeatureFactory] = registry.factories(self)
        for factory in self.factories:
            early = factory.before_packing(self)
            if early is not None:
                self.features.add(early)
        if self.device.type == "cpu":
            self.model.pack_weights()  # oneDNN's layout, once (see models.onednn)
        self.num_kv_heads = local_kv_heads(self.model_config, self.tp.size)  # this rank's
        self.block_size = config.block_size
        # Logits rows a sequence may take in one step: its token, and the features' lookahead.
        self.rows_per_seq = 1 + sum(f.lookahead_rows() for f in self.factories)
        self.sampler = Sampler()  # before the pool: the profiling run samples
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        mc = self.model_config
        # Rank 0 prepares the steps (the other ranks receive them whole).
        max_len = config.max_model_len or mc.max_position_embeddings
        self.input_batch: InputBatch | None = None
        self.grammar_masks: GrammarManager | None = None  # rank 0's grammars and bitmask
        if self.tp.rank == 0 and (self.pipeline is None or self.pipeline.where.rank == 0):
            self.grammar_masks = GrammarManager(config.max_num_seqs, mc.vocab_size,
                                                config.max_num_seqs * self.rows_per_seq)
            for factory in self.factories:  # before the masks: they may apply them
                feature = factory.build(self)
                if feature is not None:
                    self.features.add(feature)
            self.features.add(self.grammar_masks)
            self.features.add(prompt_logprobs.PromptLogprobs())
            self.input_batch = InputBatch(
                config.max_num_seqs, min(-(-max_len // self.block_size), self.num_blocks),
                mc.vocab_size, self.device, features=self.features)
        self.warmed_up: list[str] = []  # the features' paths the warm-up ran
        self.buffers: StepBuffers | None = None
        self.graphs: DecodeGraphs | None = None  # the base model's decode graphs
        self.feature_graphs: dict[tuple, DecodeGraphs] = {}  # by graph key (``step_features``)
        if self.device.type == "cpu":
            if os.environ.get(SKIP_WARM_UP_ENV) == "1":
                logger.info("warm-up skipped (%s=1)", SKIP_WARM_UP_ENV)
            else:
                self._warm_up()
        else:
            self._prepare_gpu()
        logger.info(
            "model loaded: arch=%s dtype=%s device=%s backend=%s kv_blocks=%d (%d tokens) "
            "tp_rank=%d/%d",
            self.model_config.architecture,
            self.dtype,
            self.device,
            self.attn_backend.name,
            self.num_blocks,
            self.num_blocks * self.block_size,
            self.tp.rank,
            self.tp.size,
        )

    def close(self) -> None:
        """Stops a tensor-parallel engine's workers (a no-op without them); a pipeline's
        stages first finish what is in flight and leave their loop. Then lets go of the decode
        graphs, the step buffers and the KV pool (``release_kv_pool``)."""
        if self.pipeline is not None and self.workers is not None:
            pp_stage.stop(self)
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        self.graphs, self.buffers = None, None
        self.release_kv_pool()

    def release_kv_pool(self) -> None:
        """Lets go of the KV pool; on a GPU its memory goes back to the device, where the next
        pool (another engine's in this process, or this one's after the profiling run) is
        sized from free memory: with the old one still held it got 85% of what was left."""
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- KV cache ---------------------------------------------------------------------------

    @property
    def num_local_layers(self) -> int:
        """The layers whose KV this rank holds: its pipeline stage's (all without one)."""
        return self.model_config.num_layers if self.stage is None else self.stage.num_layers

    def _decide_num_blocks(self) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        # Per rank: each holds its own KV heads of every block (and the features' KV beside
        # the model's, on the ranks that keep one).
        mc = self.model_config
        per_token = mc.kv_bytes_per_token(self.dtype) // mc.num_kv_heads * self.num_kv_heads
        per_token = per_token * self.num_local_layers // mc.num_layers  # a stage's layers
        per_token += sum(f.kv_bytes_per_token() for f in self.factories)
        bytes_per_block = per_token * self.block_size
        budget = self.config.kv_cache_memory
        if budget is None:  # the engine's memory less what its features hold back
            held = self.feature_memory = self._feature_memory()
            logger.info("KV budget: held back for the features %s", held)
            budget = self._default_kv_budget() - held.total(self.device)
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"a KV budget of {budget} bytes holds no block of {bytes_per_block} bytes "
                "(--kv-cache-memory sets it)"
            )
        # one pool size that fits every rank (of every stage)
        ranks = self.tp if self.pipeline is None else self.pipeline.world
        return ranks.min_over_ranks(int(num_blocks))

    def _feature_memory(self) -> memory_budget.FeatureMemory:
        """What the largest step with every enabled feature holds besides the KV pool
        (``memory_budget``): counted before the pool is allocated."""
        c, mc = self.config, self.model_config
        reserved: dict[str, int] = {}
        for factory in self.factories:
            reserved.update(factory.held_bytes())
        measured = profile_run.enabled() and self.pipeline is None
        return memory_budget.FeatureMemory(
            activations=memory_budget.activation_bytes(mc, c.max_num_batched_tokens,
                                                       self.tp.size, self.dtype),
            sampler=memory_budget.sampler_bytes(c.max_num_seqs * self.rows_per_seq,
                                                mc.vocab_size),
            held=self.features.held_bytes(self.device),  # those built so far: before the pool
            reserved=reserved,
            step_peak=profile_run.largest_step_peak(self) if measured else 0,
        )

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return _DEFAULT_CPU_KV_BYTES
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free * _GPU_MEMORY_FRACTION)

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mc = self.model_config
        caches = [
            self.attn_backend.allocate_kv_cache(
                num_blocks, self.block_size, self.num_kv_heads, mc.head_dim, self.dtype,
                self.device
            )
            for _ in range(self.num_local_layers)
        ]
        # The caches' half of the attention contract, once (no layer checks it again).
        check_kv_caches(
            caches,
            num_heads=mc.num_heads // self.tp.size,
            num_kv_heads=self.num_kv_heads,
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
            if n > FULL_PASS_ROWS:
                warm_up_products(self.model, n)
                continue
            table = list(range(-(-n // self.block_size)))
            meta, positions = build_attention_metadata([table], [n], [n], self.block_size,
                                                       self.device)
            self._plan(meta, n)
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            hidden = self.model(ids, positions, self.kv_caches, meta, warm_up_input(self.model, n))
            if isinstance(hidden, torch.Tensor) and (  # a pipeline's last stage makes logits
                    n <= self.config.max_num_seqs * self.rows_per_seq):  # logits rows
                self.model.compute_logits(hidden)
        self.warmed_up = warm_up_features(self, grammar_masks=False)
        logger.info("warmed up in %.1fs (and %s)", time.perf_counter() - start,
                    ", ".join(self.warmed_up))

    def warm_up_forward(self, num_tokens: int) -> None:
        """One forward of ``num_tokens`` prompt tokens in the first KV blocks, for a step
        feature's warm-up (``StepFeature.warm_up``), which sets its own state around it."""
        warm_up_forward(self, num_tokens)

    # -- GPU: staging buffers, warm-up, graphs ---------------------------------------------

    def _prepare_gpu(self) -> None:
        """Buffers, then every eager kernel variant compiled, then the decode graphs captured:
        all before the engine reports ready (a pod added under load starts at full speed)."""
        c = self.config
        max_len = c.max_model_len or self.model_config.max_position_embeddings
        width = min(-(-max_len // self.block_size), self.num_blocks)
        self.buffers = StepBuffers(
            c.max_num_batched_tokens, c.max_num_seqs, width, self.block_size, self.device
        )
        start = time.perf_counter()
        self._warm_up_gpu(width * self.block_size)
        # The torch backend plans on the host from the step's lengths: it cannot be captured.
        # Tensor-parallel ranks run eager: their steps hold NCCL collectives, whose capture
        # into graphs has not been tried on a multi-GPU machine yet.
        if not c.enforce_eager and self.attn_backend.name == "triton" and self.tp.size == 1:
            from services.engine.kernels.paged_attention import decode_num_splits

            kv_heads, longest = self.num_kv_heads, width * self.block_size

            def splits(n: int) -> int:
                return decode_num_splits(n, kv_heads, longest)

            self.graphs = self._capture(
                lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta), splits)
            for key in self.features.graph_variants():  # a feature's own (adapters': opt-in)
                self.feature_graphs[key] = self._capture(self._feature_forward(key), splits)
        logger.info("GPU warm-up and graph capture took %.1fs", time.perf_counter() - start)

    def _capture(self, forward, num_splits: Callable[[int], int]) -> DecodeGraphs:
        graphs = DecodeGraphs(forward, self.buffers, capture_sizes(self.config.max_num_seqs),
                              num_splits)
        graphs.capture()
        return graphs

    def _feature_forward(self, key: tuple):
        """The captured forward of a feature's graphs: its static layout set first (dummy
        adapters), cleared after."""

        def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata):
            self.features.capture_forward(key, len(ids))
            try:
                return self.model(ids, pos, self.kv_caches, meta)
            finally:
                self.features.after_forward()

        return forward

    @torch.inference_mode()
    def _warm_up_gpu(self, longest: int) -> None:
        """Eager steps of the shapes that pick different kernel variants (the prefill tile
        grows with the longest query: 16, 32, 64; a mixed step; a long prompt), the LM head
        and both sampler paths. Writes only into the first KV blocks, which hold nothing yet."""
        room = min(longest, self.num_blocks * self.block_size, self.config.max_num_batched_tokens)
        vocab = self.model_config.vocab_size
        greedy = SamplingBatch.from_requests(
            [SamplingRequest(SamplingParams(temperature=0.0), [0], [])], vocab, self.device)
        sampled = SamplingBatch.from_requests(
            [SamplingRequest(SamplingParams(temperature=1.0, top_p=0.9, top_k=50), [0], [])],
            vocab, self.device)
        for q_lens in ([1], [16], [32], [64], [room], [48, 1, 1, 1]):
            q_lens = [min(q, room) for q in q_lens]
            tables, seq_lens, used = [], [], 0
            for q in q_lens:
                n_blocks = -(-q // self.block_size)
                tables.append(list(range(used, used + n_blocks)))
                seq_lens.append(q)
                used += n_blocks
            if used > self.num_blocks:
                continue
            ends = np.cumsum(q_lens) - 1
            packed, lens = pack_tables(tables)
            staged = self.buffers.stage(np.zeros(sum(q_lens), np.int64), packed, lens,
                                        np.array(seq_lens), np.array(q_lens), ends)
            self._plan(staged.meta, sum(q_lens))
            hidden = self._run(staged).index_select(0, staged.logits_rows)
            logits = self.model.compute_logits(hidden)
            if logits is not None:  # rank 0 samples; the other ranks only join the gather
                self.sampler(logits[:1], greedy)
                self.sampler(logits[:1], sampled)
        self.warmed_up = warm_up_features(self, grammar_masks=True)
        torch.cuda.synchronize()

    # -- one step ---------------------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """One step, start to end (synchronous stepping)."""
        return self.run(self.prepare(sched))

    @torch.inference_mode()
    def prepare(
        self, sched: SchedulerOutput, in_flight_rows: Mapping[Request, int] | None = None
    ) -> PreparedStep:
        """The host half of a step (engine thread): the input batch's rows brought up to date
        (joins, appended blocks; the engine gave back the rows of requests that left), then
        the step's inputs gathered from them, and on
        the CPU its input tensors and attention plan. With async scheduling a request's input
        may be a token that the step in flight samples (a placeholder): ``in_flight_rows`` maps
        each request that step samples for to its row of the sampled ids, which ``run`` is
        given."""
        prepared = self._prepare_decodes(sched, in_flight_rows)
        if prepared is not None:
            return prepared
        ib = self.input_batch
        ids: list[int] = []
        rows: list[int] = []
        seq_lens: list[int] = []
        fill_at: list[int] = []
        fill_from: list[int] = []
        add, refresh, written = ib.add, ib.refresh, ib.blocks_written
        lookahead = self.features.lookahead_ids
        every_row = ib.features.penalties > 0  # their counts catch up with the new tokens
        for req, start, num, block_ids, num_drafts in zip(
                sched.requests, sched.starts, sched.num_new_tokens, sched.block_ids,
                sched.num_lookahead_tokens, strict=True):
            row = req.batch_row
            if row < 0:
                row = add(req, block_ids)
            elif every_row or len(block_ids) > written[row]:
                refresh(req, block_ids)
            toks = req.token_ids
            if num_drafts:  # the last token, then those its feature holds
                ids.append(toks[start])
                ids.extend(lookahead(row, num_drafts))
            elif num == 1 and start < len(toks):  # a decode: its last known token
                ids.append(toks[start])
            else:
                chunk = toks[start : start + num]
                if len(chunk) < num:  # at most its last token is not known yet
                    assert len(chunk) + 1 == num and in_flight_rows is not None
                    fill_at.append(len(ids) + len(chunk))
                    fill_from.append(in_flight_rows[req])
                    chunk.append(0)
                ids.extend(chunk)
            rows.append(row)
            seq_lens.append(start + num)
        n = len(rows)
        q_lens = [1] * n if sched.num_batched_tokens == n else sched.num_new_tokens
        sampled = (np.arange(n) if sched.num_sampling == n else np.flatnonzero(sched.samples))
        return self._prepared(sched, ids, rows, seq_lens, q_lens, sampled, fill_at, fill_from)

    def _prepare_decodes(self, sched: SchedulerOutput,
                         in_flight_rows: Mapping[Request, int] | None) -> PreparedStep | None:
        """``prepare`` of the common step by list operations: every request has a row and
        computes one token that it samples (its last, or with async scheduling the one on its
        way). None when the step is not that (joins, prefill chunks, lookahead tokens,
        penalised rows, whose counts catch up row by row)."""
        ib = self.input_batch
        if not sched.one_token_each or ib.features.penalties:
            return None
        reqs = sched.requests
        n = len(reqs)
        batch = sched.decode_batch
        if batch is not None:
            rows = self._batch_rows(batch)
        else:
            rows = [r.batch_row for r in reqs]
            if min(rows) < 0:
                return None
        block_ids, grown = sched.block_ids, sched.grown
        if grown is None:
            written = ib.blocks_written
            grown = [i for i, (row, ids) in enumerate(zip(rows, block_ids, strict=True))
                     if len(ids) > written[row]]
        for i in grown:
            ib.refresh(reqs[i], block_ids[i])
        starts = sched.starts
        fill_at: list[int] = []
        fill_from: list[int] = []
        if batch is not None:  # each one's last token: the last step's
            ids = batch.last_tokens
        elif in_flight_rows is None:  # every token known
            ids = list(map(getitem, [r.token_ids for r in reqs], starts))
        else:
            toks = [r.token_ids for r in reqs]
            ids = [t[s] if s < len(t) else 0 for t, s in zip(toks, starts, strict=True)]
            fill_at = [i for i, (t, s) in enumerate(zip(toks, starts, strict=True)) if s >= len(t)]
            fill_from = [in_flight_rows[reqs[i]] for i in fill_at]
        seq_lens = np.add(starts, 1)
        return self._prepared(sched, ids, rows, seq_lens, [1] * n, np.arange(n), fill_at,
                              fill_from)

    def _batch_rows(self, batch: DecodeBatch) -> np.ndarray:
        """The input-batch rows of a decode batch's requests, kept while no row moved (rows
        move when a request leaves or joins)."""
        ib = self.input_batch
        key = (batch, ib.layout)  # a request that finished left the input batch too
        if self._rows_of_batch is None or self._rows_of_batch[0] != key:
            rows = np.array([r.batch_row for r in batch.requests], dtype=np.int64)
            assert rows.min() >= 0, "a decoding request has had a step, so a row"
            self._rows_of_batch = (key, rows)
        return self._rows_of_batch[1]

    def _prepared(self, sched, ids, rows, seq_lens, q_lens, sampled, fill_at, fill_from):
        """``sampled``: the indices of the scheduled requests that sample (logits rows)."""
        ib = self.input_batch
        row_idx = np.array(rows, dtype=np.int64)
        q = np.array(q_lens, dtype=np.int64)
        seq_lens = np.array(seq_lens, dtype=np.int64)
        width = -(-int(seq_lens.max()) // self.block_size)
        batch = StepBatch(
            input_ids=np.array(ids, dtype=np.int64),
            block_tables=ib.block_table[row_idx, :width],  # a gathered copy
            num_blocks=ib.num_blocks[row_idx],
            seq_lens=seq_lens,
            query_lens=q,
            rows=sampled,
        )
        sampled_rows = row_idx[sampled]
        state = self.features.prepare_rows(
            StepRows(sched, batch, row_idx, q_lens, sampled_rows, ib))
        fill = None
        if fill_at:
            assert self.workers is None, "placeholders never cross to tensor-parallel ranks"
            fill = (torch.tensor(fill_at), torch.tensor(fill_from))  # to the device in run()
        cpu = self._cpu_inputs(batch) if self.buffers is None and self.workers is None else None
        return PreparedStep(batch, ib.sampling_batch(sampled_rows), state, fill, cpu)

    def launch(self, step: PreparedStep) -> None:
        """Pipeline parallelism: starts ``step`` down the stages before the last (rank 0's),
        so that several steps are in flight (``pipeline_batches``); ``run`` finishes it."""
        assert self.pipeline is not None and step.fill is None
        pp_stage.launch(self, step.batch)

    @torch.inference_mode()
    def run_stage(self, batch: StepBatch, received: IntermediateTensors | None) -> None:
        """A pipeline rank other than 0: its stage of ``batch``, handed on to the next stage
        (the last stage's ranks join rank 0's LM head instead)."""
        assert self.stage is not None and self.pipeline is not None
        if self.stage.is_last:
            self._logits(batch, None, None, None, received)
            return
        try:
            out, _ = self._forward_cpu(self._cpu_inputs(batch), None, batch, received)
        finally:
            self.features.after_forward()
        assert isinstance(out, IntermediateTensors)
        self.pipeline.send(batch, out.hidden, out.residual)

    @torch.inference_mode()
    def run(
        self, step: PreparedStep, in_flight_tokens: torch.Tensor | None = None
    ) -> StepResult:
        """The model half of a step: forward, logits, masks, sampling. ``in_flight_tokens``:
        the previous step's sampled ids, where ``prepare`` left placeholders (they stay on the
        device)."""
        fill = None
        if step.fill is not None:
            assert in_flight_tokens is not None
            at, rows = (t.to(self.device, non_blocking=True) for t in step.fill)
            fill = (at, in_flight_tokens.index_select(0, rows))
        self.features.before_step(step)  # before the batch crosses: it may write input ids
        shards = self._shard_plan(step)
        logits = self.forward_logits(step.batch, self.features.slice_scorer(step.state),
                                     step.cpu_inputs, fill)
        result = self._sample(step, logits, shards)
        self.features.finish(step, result)
        return result

    def _sample(self, step: PreparedStep, logits: torch.Tensor | None,
                shards: shard_sampling.ShardPlan | None) -> StepResult:
        if logits is None:
            return StepResult(SamplerOutput(token_ids=[], logprobs=[]))
        if shards is not None:  # the ranks sampled: these are the tokens
            return StepResult(SamplerOutput(logits.tolist(), [None] * len(logits), logits))
        self.features.after_logits(logits, step)  # structured outputs' masks: before sampling
        result = self.features.sample(logits, step)  # a feature that samples the step itself
        return StepResult(self.sampler(logits, step.sampling)) if result is None else result

    def _shard_plan(self, step: PreparedStep) -> shard_sampling.ShardPlan | None:
        """Rank 0: the step's plan for sampling on the shards, set on its batch (None: the
        logits are gathered). A feature may need whole rows (``whole_logits``: grammar masks,
        verified positions); a pipeline's stages pass the batch on without the plan, so a
        pipeline gathers too."""
        if (self.workers is None or self.pipeline is not None or not self.sample_on_shards
                or self.features.whole_logits(step)
                or not len(step.batch.rows)):
            return None
        plan = shard_sampling.plan(step.sampling, self.device)
        step.batch.shard_sampling = None if plan is None else plan.encode()
        return plan

    @torch.inference_mode()
    def forward_logits(
        self,
        batch: StepBatch,
        score: Callable[[torch.Tensor], None] | None = None,
        cpu_inputs: CpuInputs | None = None,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Runs the model over ``batch``; returns the logits of its ``rows`` (float32), or None
        without rows or on a tensor-parallel rank other than 0; with ``batch.shard_sampling``
        the rows' sampled token ids instead (the ranks sample their shards). The logits of
        each hidden-row slice in ``batch.scored`` go to ``score`` first (rank 0; every rank
        computes them, as the LM head is a collective). ``cpu_inputs``: the batch's tensors
        if ``prepare`` built them; ``fill``: (positions, token ids) that replace placeholder
        input ids. Rank 0 sends the batch to the other ranks first, and a failure after that
        is fatal (``WorkerGroup.abort``): the ranks would be out of step."""
        if self.workers is None:
            return self._logits(batch, score, cpu_inputs, fill)
        try:
            received = None
            if self.pipeline is None:
                send_step(self.tp, batch)
            else:  # the last stage: from the one before it (``launch`` may have sent it)
                received = pp_stage.last_stage_input(self.pipeline, batch)
            return self._logits(batch, score, cpu_inputs, fill, received)
        except Exception as exc:  # any failure here leaves the ranks apart
            logger.exception("tensor-parallel step failed on rank 0")
            self.workers.abort(f"a step failed on rank 0 ({type(exc).__name__}: {exc})")
            raise  # not reached: abort exits

    def _logits(
        self,
        batch: StepBatch,
        score: Callable[[torch.Tensor], None] | None,
        cpu_inputs: CpuInputs | None = None,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
        received: IntermediateTensors | None = None,
    ) -> torch.Tensor | None:
        try:
            if self.buffers is None:
                hidden, last = self._forward_cpu(cpu_inputs or self._cpu_inputs(batch), fill,
                                                 batch, received)
            else:
                hidden, last = self._forward_gpu(batch, fill)
        finally:
            self.features.after_forward()
        # hidden holds every new token's row (a decode graph's: one per request)
        for row, count in zip(batch.scored[::2], batch.scored[1::2], strict=True):
            logits = self.model.compute_logits(hidden[row : row + count])
            if score is not None and logits is not None:
                score(logits)
        if not len(batch.rows):
            return None
        rows = hidden if last is None else hidden.index_select(0, last)
        if batch.shard_sampling is not None:
            return self._sample_shards(rows, shard_sampling.ShardPlan.decode(batch.shard_sampling))
        return self.model.compute_logits(rows)

    def _sample_shards(self, hidden: torch.Tensor,
                       plan: shard_sampling.ShardPlan) -> torch.Tensor | None:
        head = self.model.lm_head  # its vocabulary rows: [vocab_start, + vocab_real)
        logits = self.model.shard_logits(hidden)[:, : head.vocab_real].contiguous()
        return shard_sampling.sample(logits, plan, self.tp, head.vocab_start)

    @property
    def masker(self) -> TokenMasker | None:
        """The grammar masks' bitmask buffer (None until a step or the warm-up needed it)."""
        return None if self.grammar_masks is None else self.grammar_masks.masker

    def _cpu_inputs(self, batch: StepBatch) -> CpuInputs:
        step = plan_step(batch.block_tables, batch.num_blocks, batch.seq_lens, batch.query_lens,
                         self.block_size)
        meta, positions = to_metadata(step, self.block_size, self.device)
        check_step(meta, len(batch.input_ids), self.kv_caches[0][0])  # the plan: in the forward
        ids = torch.from_numpy(batch.input_ids)  # shares memory: ``before_step``'s writes show
        # Every token's row gets logits when each request brings one and samples it (decodes):
        # the hidden states are the logits rows, no gather.
        n = len(batch.rows)
        every = n == len(batch.input_ids) == len(batch.seq_lens) and batch.extra_logits is None
        last = None if every or not n else torch.from_numpy(batch.logits_rows())
        return CpuInputs(ids, positions, meta, last, self.features.host_inputs(batch))

    def _plan(self, meta: AttentionMetadata, num_tokens: int) -> None:
        """The step's contract checked and its attention plan built: once per step, for every
        layer (``attention.base``)."""
        check_step(meta, num_tokens, self.kv_caches[0][0])
        self.model.plan_attention(meta)

    def _forward_cpu(self, inputs: CpuInputs, fill, batch: StepBatch, received=None):
        """Returns the hidden states and the rows of them that get logits. The attention plan
        is built here, on the thread that runs the model: its torch ops may go parallel, and
        a second OpenMP team (the engine thread's, under async scheduling) would throttle the
        model's."""
        if fill is not None:
            inputs.input_ids.index_copy_(0, *fill)
        self.model.plan_attention(inputs.meta)
        self.features.before_forward(batch, inputs.features)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                            received)
        return hidden, inputs.logits_rows

    def _forward_gpu(self, batch: StepBatch, fill):
        """As ``_forward_cpu``; decode steps replay a graph, every step's inputs cross in one
        copy (``StepBuffers``), the logits rows with them; placeholder ids are filled from the
        previous step's sampled ids on the device, after that copy."""
        assert self.buffers is not None
        input_ids, query_lens, rows = batch.input_ids, batch.query_lens, batch.rows
        num_seqs = len(batch.seq_lens)
        decode = len(input_ids) == num_seqs
        graphs = self._graphs_of(batch) if decode else None
        bucket = None if graphs is None else graphs.bucket(num_seqs)
        if bucket is None:
            self.features.before_forward(batch, {})
        else:
            self.features.before_replay(batch, self.features.graph_key(batch), bucket)
        staged = self.buffers.stage(
            input_ids, batch.block_tables, batch.num_blocks, batch.seq_lens, query_lens,
            batch.logits_rows(), pad_to=bucket,
        )
        self._plan(staged.meta, len(input_ids))
        if fill is not None:
            staged.input_ids.index_copy_(0, *fill)
        if bucket is not None:
            hidden = graphs.replay(bucket)[:num_seqs]
        else:
            hidden = self._run(staged)
        # Every request of a decode step samples: its rows are the hidden states as they are.
        all_rows = decode and len(rows) == num_seqs
        return hidden, None if all_rows else staged.logits_rows

    def _graphs_of(self, batch: StepBatch) -> DecodeGraphs | None:
        """The graphs a decode step replays: the base model's, or those of the features'
        parts in its key (``StepFeature.graph_key``); None: it runs eager."""
        key = self.features.graph_key(batch)
        if key is None or self.graphs is None:
            return None
        return self.graphs if key == () else self.feature_graphs.get(key)

    def _run(self, staged: StagedStep) -> torch.Tensor:
        return self.model(staged.input_ids, staged.positions, self.kv_caches, staged.meta)
