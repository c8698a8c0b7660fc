"""Triton paged attention: decode (one query per sequence) and varlen prefill over a prefix.

Both kernels read K/V through the block table (token at position p of sequence s lives in slot
``block_tables[s, p // block_size] * block_size + p % block_size``), keep FlashAttention's
running max / running sum per query row in float32 (online softmax, so a context is read once,
tile by tile), and accept fp16, bf16 or fp32 inputs. Scores are kept in the base-2 domain:
``scale * log2(e)`` is folded into the scale so ``exp2`` replaces ``exp``.

Decode, one program per (sequence, KV head, split)::

    queries  q[h*g .. h*g+g-1]   the g query heads of KV head h, padded to BLOCK_G >= 16 rows
    keys     tiles of BLOCK_N positions; a tile's block ids are loaded once per KV block
    split k  positions [k * L, (k+1) * L), L = ceil(ceil(context_len / S) / BLOCK_N) * BLOCK_N

Decode is memory-bound (each K/V byte is used by only g query rows), so the kernel is built to
keep loads in flight: both products are ``tl.dot`` on the tensor cores (the padding rows cost
no bandwidth), K and V tiles are requested together, and ``num_stages`` lets Triton pipeline
the next tiles' loads. Each sequence sizes its splits from its own ``context_len``, in the
kernel: the launch depends only on the batch size and the split count S, so a CUDA graph can
replay it while contexts grow, and splits past a short context are simply empty. With one split
the program writes the output directly; with several (small batches or long contexts would
otherwise leave most of the GPU idle) each writes its partial (max, sum, unnormalised
accumulator) and a second kernel merges them. Tile shape, warps, stages and the split policy
are a ``DecodeConfig``, chosen per (head_dim, group, dtype) by ``decode_config``.

Prefill, one program per (sequence, query head, tile of BLOCK_M new tokens). The new tokens are
the LAST q_len of the context, so row j sits at position ``context_len - q_len + j`` and sees
keys ``0 ..`` that position; tiles past the row's diagonal are never loaded.

Sliding window (Mistral, Gemma's local layers): a row at position p sees keys
``p - window < k <= p``. Decode starts its splits at the window's first key, rounded down to a
tile (earlier keys of that tile are masked), so a long context costs ``window`` keys; prefill
starts each row tile's key loop at its first row's window and masks per row. Soft-capping
(Gemma 2): ``cap * tanh(scores / cap)`` on the scaled scores, before the mask.

The torch reference is ``TorchAttentionBackend.forward``. The wrappers validate nothing per
call: the caches are checked once when allocated and each step's metadata once before the model
runs (``attention.contract``); the query is a view of the model's fused projection, unit-strided
over head_dim by construction. ``check_decode_args`` / ``check_prefill_args`` state what the
kernels index beyond that (the tests call them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.engine.kernels import dot_modes, triton_only

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU-only install: the torch backend does not need this module
    triton = None

_LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Meta-parameters of the decode kernel and the policy that picks its split count."""

    block_n: int = 64  # keys per tile: a power of two >= 16 (tl.dot's minimum)
    num_warps: int = 4
    num_stages: int = 2  # software-pipelining depth of the K/V loads (1: none)
    # Without an explicit num_splits: split until seqs * KV heads * splits reaches
    # target_programs (about one wave of resident programs on an H200), never below
    # min_split_tokens per split.
    target_programs: int = 1024
    min_split_tokens: int = 32
    max_splits: int = 32

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if min(self.num_warps, self.num_stages, self.target_programs, self.max_splits) < 1:
            raise ValueError(f"decode config values must be positive: {self}")


# The default is safe everywhere (no register spills up to head_dim 128, fp32 included). The
# table holds what measured best on an H200 (benchmarks/decode_attention_bench.py, 2026-12-01;
# 32/8 heads, blocks of 16): within 2% of each shape's best from 1x1024 to 256x1024. Small
# tiles on one or two warps keep many programs resident per SM; deeper pipelines take more
# shared memory, fit fewer, and lost 10% at 256 sequences. Keyed by (head_dim, query rows per
# program, dtype): a tile's work depends on the group padded to 16 rows, not on the group
# itself, and fp16 moves the same bytes through the same MMAs as bf16.
_DEFAULT_DECODE_CONFIG = DecodeConfig()
_MEASURED = {
    64: DecodeConfig(block_n=32, num_warps=1, num_stages=2),
    128: DecodeConfig(block_n=32, num_warps=2, num_stages=2),
}
_DECODE_CONFIGS: dict[tuple[int, int, torch.dtype], DecodeConfig] = {
    (head_dim, 16, dtype): config
    for head_dim, config in _MEASURED.items()
    for dtype in (torch.bfloat16, torch.float16)
}


def decode_config(head_dim: int, group: int, dtype: torch.dtype) -> DecodeConfig:
    """The decode kernel's meta-parameters for a model's head_dim, GQA group and dtype."""
    key = (head_dim, _query_rows(group), dtype)
    return _DECODE_CONFIGS.get(key, _DEFAULT_DECODE_CONFIG)


def _query_rows(group: int) -> int:
    """A program's query rows: its group, padded for tl.dot (>= 16, a power of two)."""
    return max(16, 1 << (group - 1).bit_length())


def decode_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    *,
    config: DecodeConfig = _DEFAULT_DECODE_CONFIG,
) -> int:
    """How many splits ``paged_decode_attention`` cuts each context into.

    Call it once per CUDA-graph batch size with the longest context the graph may meet: each
    sequence splits its own context in the kernel, so a short one leaves trailing splits empty
    (they cost a program that exits at once and a partial the merge weighs 0).
    """
    by_occupancy = math.ceil(config.target_programs / max(1, num_seqs * num_kv_heads))
    by_length = math.ceil(max(1, max_context_len) / config.min_split_tokens)
    return max(1, min(by_occupancy, by_length, config.max_splits))


if triton is not None:

    @triton.jit
    def _soft_cap(s, cap):
        """``cap * tanh(s / cap)``; tanh through the sigmoid (the interpreter has no libdevice).
        Scores are in the base-2 domain and ``cap`` was scaled alike, so capping commutes."""
        return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)

    @triton.jit
    def _tile_rows(
        table_ptr,  # the sequence's row of the block table
        start,  # the tile's first position, a multiple of BLOCK_N
        hi,  # the end of the program's keys
        cache_stride_b,
        cache_stride_s,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Cache offsets of the tile's BLOCK_N token rows, one block-id load per KV block."""
        if BLOCK_N <= BLOCK_SIZE:
            # Tiles start at multiples of BLOCK_N, which divides BLOCK_SIZE: one block.
            ids = tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int64)
        else:
            j = tl.arange(0, BLOCK_N // BLOCK_SIZE)
            # The last tile's blocks past the context may lie past the table's row: id 0 there
            # (a real block; its rows are masked).
            blocks = tl.load(
                table_ptr + start // BLOCK_SIZE + j, mask=start + j * BLOCK_SIZE < hi, other=0
            )
            per_token = tl.broadcast_to(blocks[:, None], [BLOCK_N // BLOCK_SIZE, BLOCK_SIZE])
            ids = tl.reshape(per_token, [BLOCK_N]).to(tl.int64)
        # Multiplying the ids (not the reshaped offsets) keeps the strides' alignment visible
        # to the compiler, so the row loads stay 16-byte vectors.
        within = (start + tl.arange(0, BLOCK_N)) % BLOCK_SIZE
        return ids * cache_stride_b + within * cache_stride_s

    @triton.jit(do_not_specialize=["num_splits", "bt_stride"])
    def _decode_kernel(
        out_ptr,  # [T, H, D] (one split) or partial accumulators [T, H, S, D] fp32
        max_ptr,  # [T, H, S] fp32 running max per split (unused with one split)
        sum_ptr,  # [T, H, S] fp32 running sum per split (unused with one split)
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        qk_scale,  # softmax scale * log2(e)
        softcap,  # the logit soft-cap * log2(e) (read only when SOFTCAP)
        window,  # sliding window: keys p - window < k <= p; 0 = the whole context
        num_splits,
        q_stride_t,
        q_stride_h,
        o_stride_t,
        o_stride_h,
        cache_stride_b,
        cache_stride_s,
        cache_stride_h,
        bt_stride,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PARTIALS: tl.constexpr,  # num_splits > 1: write partials for the merge kernel
        SOFTCAP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx_len = tl.load(context_lens_ptr + seq)
        # The window's first key; splits and tiles start on BLOCK_N multiples below it.
        first = tl.where(window > 0, tl.maximum(ctx_len - window, 0), 0)
        base = first // BLOCK_N * BLOCK_N
        split_len = tl.cdiv(tl.cdiv(ctx_len - base, num_splits), BLOCK_N) * BLOCK_N
        lo = base + split * split_len
        hi = tl.minimum(lo + split_len, ctx_len)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        heads = kv_head * GROUP + g
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        gd_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(
            q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
            mask=gd_mask,
            other=0.0,
        )
        if UPCAST_DOT:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        table_ptr = block_tables_ptr + seq * bt_stride
        head_offs = kv_head * cache_stride_h + d
        for start in range(lo, hi, BLOCK_N):
            rows = _tile_rows(
                table_ptr, start, hi, cache_stride_b, cache_stride_s, BLOCK_SIZE, BLOCK_N
            )
            valid = (start + n < hi) & (start + n >= first)
            offs = rows[:, None] + head_offs[None, :]
            nd_mask = valid[:, None] & d_mask[None, :]
            # V is requested with K, before the scores: both tiles' latencies overlap.
            k = tl.load(k_cache_ptr + offs, mask=nd_mask, other=0.0)
            v = tl.load(v_cache_ptr + offs, mask=nd_mask, other=0.0)
            if UPCAST_DOT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            if SOFTCAP:
                s = _soft_cap(s, softcap)
            # Every tile holds a valid key (the first tile of split 0 holds `first`), so m_new
            # is finite and masked keys weigh exp2(-inf).
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if PARTIALS:
            # Laid out [T, H, S(, D)] contiguous; an empty split leaves (-inf, 0, 0).
            stat = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
            tl.store(max_ptr + stat, m_i, mask=g_mask)
            tl.store(sum_ptr + stat, l_i, mask=g_mask)
            tl.store(out_ptr + stat[:, None] * HEAD_DIM + d[None, :], acc, mask=gd_mask)
        else:
            # l_i is 0 only for an empty context (a padded graph slot): zeros, not NaN.
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_offs = seq * o_stride_t + heads[:, None] * o_stride_h + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_splits_kernel(
        out_ptr,
        part_ptr,  # [T, H, S, D] fp32
        max_ptr,  # [T, H, S] fp32
        sum_ptr,  # [T, H, S] fp32
        num_splits,
        o_stride_t,
        o_stride_h,
        HEAD_DIM: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_mask = s < num_splits
        stat = (seq * tl.num_programs(1) + head) * num_splits + s
        m = tl.load(max_ptr + stat, mask=s_mask, other=float("-inf"))
        m_all = tl.max(m, axis=0)
        # Empty splits weigh exp2(-inf) = 0. Only an empty context (a padded CUDA-graph slot)
        # has m_all = -inf: subtract 0 there instead (-inf - -inf would be NaN).
        w = tl.exp2(m - tl.where(m_all > float("-inf"), m_all, 0.0))
        total = tl.sum(w * tl.load(sum_ptr + stat, mask=s_mask, other=0.0), axis=0)
        sd_mask = s_mask[:, None] & (d < HEAD_DIM)[None, :]
        part = tl.load(part_ptr + stat[:, None] * HEAD_DIM + d[None, :], mask=sd_mask, other=0.0)
        out = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0, total, 1.0)
        o_offs = seq * o_stride_t + head * o_stride_h + d
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _prefill_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        cu_seqlens_q_ptr,
        qk_scale,  # softmax scale * log2(e)
        softcap,  # the logit soft-cap * log2(e) (read only when SOFTCAP)
        window,  # sliding window: keys p - window < k <= p; 0 = the whole context
        q_stride_t,
        q_stride_h,
        o_stride_t,
        o_stride_h,
        cache_stride_b,
        cache_stride_s,
        cache_stride_h,
        bt_stride,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        tile_start = tl.program_id(2) * BLOCK_M
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if tile_start < q_len:  # the grid is sized for the longest query; others end early
            ctx_len = tl.load(context_lens_ptr + seq)
            kv_head = head // GROUP
            m = tile_start + tl.arange(0, BLOCK_M)
            d = tl.arange(0, BLOCK_D)
            n = tl.arange(0, BLOCK_N)
            m_mask = m < q_len
            d_mask = d < HEAD_DIM
            # Padding rows (m >= q_len) get positions past the context: they see every key,
            # so no row is ever fully masked (and none produces NaN); they are not stored.
            q_pos = ctx_len - q_len + m
            tok = (q_start + m).to(tl.int64)
            q_offs = tok[:, None] * q_stride_t + head * q_stride_h + d[None, :]
            md_mask = m_mask[:, None] & d_mask[None, :]
            q = tl.load(q_ptr + q_offs, mask=md_mask, other=0.0)
            if UPCAST_DOT:
                q = q.to(tl.float32)

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            # Keys past the tile's last row are invisible to the whole tile.
            hi = tl.minimum(ctx_len, ctx_len - q_len + tile_start + BLOCK_M)
            # Keys before the tile's first row's window are invisible to the whole tile.
            lo = tl.where(window > 0, tl.maximum(ctx_len - q_len + tile_start - window + 1, 0), 0)
            lo = lo // BLOCK_N * BLOCK_N
            for start in range(lo, hi, BLOCK_N):
                pos = start + n
                valid = pos < hi
                block = tl.load(
                    block_tables_ptr + seq * bt_stride + pos // BLOCK_SIZE, mask=valid, other=0
                ).to(tl.int64)
                rows = block * cache_stride_b + (pos % BLOCK_SIZE) * cache_stride_s
                offs = rows[:, None] + kv_head * cache_stride_h + d[None, :]
                nd_mask = valid[:, None] & d_mask[None, :]
                k = tl.load(k_cache_ptr + offs, mask=nd_mask, other=0.0)
                if UPCAST_DOT:
                    k = k.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
                if SOFTCAP:
                    s = _soft_cap(s, softcap)
                visible = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
                in_window = (pos[None, :] > q_pos[:, None] - window) | (window == 0)
                visible = visible & in_window
                s = tl.where(visible, s, float("-inf"))
                # A row may see no key of a tile (before its window, or past its diagonal):
                # its max stays -inf, and subtracting 0 instead keeps exp2 at 0, not NaN.
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_cache_ptr + offs, mask=nd_mask, other=0.0)
                if UPCAST_DOT:
                    v = v.to(tl.float32)
                pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

            # Padding rows past a window may have seen nothing (l_i = 0); they are not stored.
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_offs = tok[:, None] * o_stride_t + head * o_stride_h + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=md_mask)

    # (tl.dot precision, bf16 upcast) per dtype, fixed by how the kernels were defined.
    _DOT_MODES = dot_modes(isinstance(_decode_kernel, InterpretedFunction))


# ---------------------------------------------------------------------- wrappers


@triton_only
def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one new query per sequence over its whole paged context (or its last
    ``window`` positions), its scores soft-capped at ``softcap`` when given.

    ``query``: ``[num_seqs, num_heads, head_dim]`` (unit stride over head_dim);
    ``block_tables``: ``[num_seqs, max_blocks]``; ``context_lens``: ``[num_seqs]`` (the new
    token included; 0 gives zeros, for padded CUDA-graph slots). ``num_splits`` fixes the
    context split (a CUDA graph must: see ``decode_num_splits``); without it the split is
    planned from ``max_context_len`` (a host int, e.g. ``meta.max_seqlen_k``; default: the
    block table's width). ``config`` overrides ``decode_config`` (benchmarks sweep it). The
    caches and the metadata tensors must satisfy ``attention.contract`` (checked once, not here),
    the other arguments ``check_decode_args``.
    """
    num_seqs = block_tables.shape[0]
    out = _output(query, out)
    if num_seqs == 0:
        return out
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cfg = config or decode_config(head_dim, num_heads // num_kv_heads, query.dtype)
    if num_splits is None:
        if max_context_len is None:
            max_context_len = block_tables.shape[1] * block_size
        if window is not None:  # the keys a sequence reads, its first tile aligned down
            max_context_len = min(max_context_len, window + cfg.block_n)
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_context_len, config=cfg)
    extras = (window, softcap)
    if num_splits == 1:
        _launch_decode(
            query, k_cache, v_cache, block_tables, context_lens, scale, out, None, cfg, extras
        )
        return out
    # Allocated per call: under CUDA graph capture these come from the graph's memory pool.
    part = query.new_empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32)
    max_buf = query.new_empty((num_seqs, num_heads, num_splits), dtype=torch.float32)
    sum_buf = torch.empty_like(max_buf)
    partials = (part, max_buf, sum_buf)
    _launch_decode(
        query, k_cache, v_cache, block_tables, context_lens, scale, out, partials, cfg, extras
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        out,
        part,
        max_buf,
        sum_buf,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


def _launch_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    cfg: DecodeConfig,
    extras: tuple[int | None, float | None],
) -> None:
    """One decode launch: into ``out``, or into ``partials`` (accumulators [T, H, S, D], maxes
    and sums [T, H, S]) for the merge kernel. ``out``'s strides are passed either way (unused
    with partials), so the split count never changes an integer Triton specialises on.
    ``extras``: the sliding window and the logit soft-cap (None: off)."""
    window, softcap = extras
    dest, max_buf, sum_buf = partials or (out, out, out)
    num_splits = dest.shape[2] if partials else 1
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    precision, upcast = _DOT_MODES[query.dtype]
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        dest,
        max_buf,
        sum_buf,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale * _LOG2E,
        (softcap or 1.0) * _LOG2E,
        window or 0,
        num_splits,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        PARTIALS=num_splits > 1,
        SOFTCAP=softcap is not None,
        # tl.dot needs >= 16 rows; the padding rows cost no memory traffic.
        BLOCK_G=_query_rows(group),
        BLOCK_N=cfg.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=precision,
        UPCAST_DOT=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


@triton_only
def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries (the last ``q_len`` of its context),
    within the last ``window`` positions of each query when given, the scores soft-capped at
    ``softcap`` when given.

    ``query``: ``[num_tokens, num_heads, head_dim]`` flattened over sequences, split by
    ``cu_seqlens_q`` (``[num_seqs + 1]``); ``max_seqlen_q`` (host int) sizes the grid. Handles
    any mix of prefills, chunks over a cached prefix and single-token decodes. The caches and
    the metadata tensors must satisfy ``attention.contract`` (checked once, not here), the
    other arguments ``check_prefill_args``.
    """
    num_seqs = block_tables.shape[0]
    out = _output(query, out)
    if num_seqs == 0 or max_seqlen_q == 0:
        return out
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs >= 16 per side
    block_m = min(64, max(16, triton.next_power_of_2(max_seqlen_q)))
    block_n = 64 if block_d <= 64 else 32
    grid = (num_seqs, num_heads, triton.cdiv(max_seqlen_q, block_m))
    precision, upcast = _DOT_MODES[query.dtype]
    _prefill_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_seqlens_q,
        scale * _LOG2E,
        (softcap or 1.0) * _LOG2E,
        window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=precision,
        UPCAST_DOT=upcast,
        SOFTCAP=softcap is not None,
    )
    return out


def check_decode_args(
    query: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> None:
    """What ``paged_decode_attention`` indexes beyond the attention contract: one query per
    sequence, unit-strided over head_dim, at least one split, an ``out`` like the query."""
    assert query.shape[0] == block_tables.shape[0], "decode takes one query per sequence"
    check_prefill_args(query, out=out)
    assert num_splits is None or num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"


def check_prefill_args(query: torch.Tensor, *, out: torch.Tensor | None = None) -> None:
    """What ``paged_prefill_attention`` indexes beyond the attention contract: a query
    unit-strided over head_dim, and an ``out`` of its shape and dtype, unit-strided too."""
    assert query.dim() == 3 and query.stride(2) == 1, "query needs a unit stride over head_dim"
    assert out is None or (
        out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    ), "out must match query's shape and dtype, with a unit stride over head_dim"


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(query.shape, dtype=query.dtype, device=query.device) if out is None else out
