"""Triton paged attention: decode (one query per sequence) and varlen prefill over a prefix.

Both kernels read K/V through the block table (token at position p of sequence s lives in slot
``block_tables[s, p // block_size] * block_size + p % block_size``), keep FlashAttention's
running max / running sum per query row in float32 (online softmax, so a context is read once,
tile by tile), and accept fp16, bf16 or fp32 inputs. Scores are kept in the base-2 domain:
``scale * log2(e)`` is folded into the scale so ``exp2`` replaces ``exp``.

Decode, one program per (sequence, KV head, split)::

    queries  q[h*g .. h*g+g-1]  (all g query heads of KV head h share each K/V tile load)
    keys     split k covers positions [k * split_len, (k+1) * split_len)

With one split the program writes the output directly. With several (small batches with long
contexts would otherwise leave most of the GPU idle) each split writes its partial
(max, sum, unnormalised accumulator) and a second kernel merges them.

Prefill, one program per (sequence, query head, tile of BLOCK_M new tokens). The new tokens are
the LAST q_len of the context, so row j sits at position ``context_len - q_len + j`` and sees
keys ``0 ..`` that position; tiles past the row's diagonal are never loaded.

The torch reference is ``TorchAttentionBackend.forward``. The wrappers validate nothing per
call: the caches are checked once when allocated and each step's metadata once before the model
runs (``attention.contract``); only the asserts that guard memory the kernels index remain.
"""

from __future__ import annotations

import math

import torch

from services.engine.kernels import interpreter_enabled, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch backend does not need this module
    triton = None

_LOG2E = 1.4426950408889634
# Below this many (sequence, KV head) programs a decode launch splits the context (see above).
_TARGET_DECODE_PROGRAMS = 256
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 32


if triton is not None:

    @triton.jit
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
        split_len,  # keys per split, a multiple of BLOCK_N
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
        NUM_SPLITS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx_len = tl.load(context_lens_ptr + seq)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        heads = kv_head * GROUP + g
        gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(
            q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
            mask=gd_mask,
            other=0.0,
        ).to(tl.float32)
        q = q * qk_scale

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        lo = split * split_len
        hi = tl.minimum(lo + split_len, ctx_len)
        for start in range(lo, hi, BLOCK_N):
            pos = start + n
            valid = pos < hi
            block = tl.load(
                block_tables_ptr + seq * bt_stride + pos // BLOCK_SIZE, mask=valid, other=0
            ).to(tl.int64)
            rows = block * cache_stride_b + (pos % BLOCK_SIZE) * cache_stride_s
            offs = rows[:, None] + kv_head * cache_stride_h + d[None, :]
            nd_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(k_cache_ptr + offs, mask=nd_mask, other=0.0).to(tl.float32)
            # [G, N]: a broadcast-multiply-reduce; G is far below tl.dot's 16-row minimum.
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + offs, mask=nd_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new

        if NUM_SPLITS == 1:
            # l_i is 0 only for an empty context; emit zeros rather than NaN.
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_offs = seq * o_stride_t + heads[:, None] * o_stride_h + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)
        else:
            # Partials, laid out [T, H, S(, D)] contiguous; an empty split leaves (-inf, 0, 0).
            stat = (seq * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
            g_mask = g < GROUP
            tl.store(max_ptr + stat, m_i, mask=g_mask)
            tl.store(sum_ptr + stat, l_i, mask=g_mask)
            tl.store(out_ptr + stat[:, None] * HEAD_DIM + d[None, :], acc, mask=gd_mask)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,
        part_ptr,  # [T, H, S, D] fp32
        max_ptr,  # [T, H, S] fp32
        sum_ptr,  # [T, H, S] fp32
        o_stride_t,
        o_stride_h,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_mask = s < NUM_SPLITS
        stat = (seq * NUM_HEADS + head) * NUM_SPLITS + s
        m = tl.load(max_ptr + stat, mask=s_mask, other=float("-inf"))
        m_all = tl.max(m, axis=0)
        # Split 0 always holds keys, so m_all is finite and empty splits weigh exp2(-inf) = 0.
        w = tl.exp2(m - m_all)
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
            for start in range(0, hi, BLOCK_N):
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
                visible = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
                s = tl.where(visible, s, float("-inf"))
                # Key 0 is in the first tile and visible to every row, so m_new is finite
                # from the first tile on and fully masked rows of later tiles add exp2(-inf)=0.
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_cache_ptr + offs, mask=nd_mask, other=0.0)
                if UPCAST_DOT:
                    v = v.to(tl.float32)
                pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

            out = acc / l_i[:, None]
            o_offs = tok[:, None] * o_stride_t + head * o_stride_h + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=md_mask)


# ---------------------------------------------------------------------- wrappers


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
) -> torch.Tensor:
    """Attention of one new query per sequence over its whole paged context.

    ``query``: ``[num_seqs, num_heads, head_dim]`` (unit stride over head_dim);
    ``block_tables``: ``[num_seqs, max_blocks]``; ``context_lens``: ``[num_seqs]`` (>= 1, the
    new token included). ``max_context_len`` (a host int, e.g. ``meta.max_seqlen_k``) sizes
    the context split; without it the block table's width bounds it. ``num_splits`` overrides
    the heuristic (tests use it to exercise both paths). The caches and the metadata tensors
    must satisfy ``attention.contract`` (checked once, not here).
    """
    require_triton()
    num_seqs = block_tables.shape[0]
    assert query.shape[0] == num_seqs, "decode takes one query per sequence"
    assert query.stride(2) == 1, "query needs a unit stride over head_dim"
    out = _output(query, out)
    if num_seqs == 0:
        return out
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    block_g = max(2, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(head_dim)
    # Keep the [G, N, D] product tile near 8K elements (registers per thread on a GPU).
    block_n = min(64, max(16, triton.next_power_of_2(8192 // (block_g * block_d))))
    splits, split_len = _plan_splits(
        num_seqs * num_kv_heads, max(1, max_context_len), block_n, num_splits
    )
    part = max_buf = sum_buf = out
    if splits > 1:
        part = query.new_empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32)
        max_buf = query.new_empty((num_seqs, num_heads, splits), dtype=torch.float32)
        sum_buf = torch.empty_like(max_buf)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        part,
        max_buf,
        sum_buf,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale * _LOG2E,
        split_len,
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
        NUM_SPLITS=splits,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    if splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out,
            part,
            max_buf,
            sum_buf,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)),
            BLOCK_D=block_d,
        )
    return out


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
) -> torch.Tensor:
    """Causal attention of each sequence's new queries (the last ``q_len`` of its context).

    ``query``: ``[num_tokens, num_heads, head_dim]`` flattened over sequences, split by
    ``cu_seqlens_q`` (``[num_seqs + 1]``); ``max_seqlen_q`` (host int) sizes the grid. Handles
    any mix of prefills, chunks over a cached prefix and single-token decodes. The caches and
    the metadata tensors must satisfy ``attention.contract`` (checked once, not here).
    """
    require_triton()
    num_seqs = block_tables.shape[0]
    assert query.stride(2) == 1, "query needs a unit stride over head_dim"
    out = _output(query, out)
    if num_seqs == 0 or max_seqlen_q == 0:
        return out
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs >= 16 per side
    block_m = min(64, max(16, triton.next_power_of_2(max_seqlen_q)))
    block_n = 64 if block_d <= 64 else 32
    grid = (num_seqs, num_heads, triton.cdiv(max_seqlen_q, block_m))
    # Triton's CPU interpreter multiplies bf16 tl.dot operands as raw uint16 bits; there the
    # dots run in fp32 instead (on a GPU bf16 stays on the tensor cores).
    upcast = query.dtype == torch.bfloat16 and interpreter_enabled()
    _prefill_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_seqlens_q,
        scale * _LOG2E,
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
        # fp32 inputs would otherwise be truncated to TF32 on tensor cores.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32",
        UPCAST_DOT=upcast,
    )
    return out


def _plan_splits(
    num_programs: int, max_context_len: int, block_n: int, num_splits: int | None
) -> tuple[int, int]:
    """Returns (splits, keys per split); split lengths are whole BLOCK_N tiles."""
    if num_splits is None:
        by_occupancy = math.ceil(_TARGET_DECODE_PROGRAMS / num_programs)
        by_length = math.ceil(max_context_len / _MIN_SPLIT_TOKENS)
        num_splits = min(by_occupancy, by_length, _MAX_SPLITS)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split_len = math.ceil(math.ceil(max_context_len / num_splits) / block_n) * block_n
    return math.ceil(max_context_len / split_len), split_len


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1, (
        "out must match query's shape and dtype, with a unit stride over head_dim"
    )
    return out
