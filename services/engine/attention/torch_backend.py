"""The torch attention backend: the CPU hot path and the reference for the Triton kernels.

Decode requests (one new token each) are batched. On the CPU, attention over a decode batch
is bound by memory traffic, not arithmetic, so the batched path is built to touch the cache as
few times as possible:

* keys: gathered through the block tables into one padded ``[B, max_len, H_kv * D]`` tensor
  with a single ``index_select``; one ``bmm`` against block-diagonal queries (query head h
  holds its D values in the column block of its KV head, zeros elsewhere) yields every head's
  scores at once, GQA included, without copying or repeating KV heads;
* values: never gathered. ``embedding_bag`` reads each value row straight from the cache and
  sums it weighted by its probability, one bag per (request, head), ragged lengths and all.

That reads K twice and V once instead of gather-K, gather-V, then read both again. It needs
float32 scores (bf16 scores before the softmax would be too coarse) and pays off from a few
requests on; small or non-fp32 batches take one masked ``scaled_dot_product_attention`` over
gathered K/V, where a request's ``num_heads`` queries are viewed as ``[num_kv_heads, group,
D]`` so each KV head meets its group as a short query "sequence" (no copy for GQA).

Requests with several new tokens (prefill, chunked prefill over a cached prefix) run one SDPA
call each; their queries are the LAST ``q_len`` tokens of the context, so unless there is no
cached prefix (``q_len == context_len``, plain ``is_causal``) they get an explicit mask aligned
to the bottom-right corner::

    keys ->      p0 p1 p2 p3 p4        context_len = 5, q_len = 2
    query j=0     1  1  1  1  .        position 3 sees keys 0..3
    query j=1     1  1  1  1  1        position 4 sees keys 0..4

The per-step bookkeeping (which requests decode, gather indices, masks, bag rows, and the
windowed layers' key groups) depends only on the metadata and the model's layout, so the
runner builds it once per step (``plan``) and every layer reads it from ``meta.plan``. Padding
keys are masked, never skipped, so the cache must hold finite values everywhere (the runner
allocates it zeroed).

Nothing here validates its arguments: the runner checks the caches once when it allocates them
and each step's metadata once before the model runs (``attention.contract``), so the per-layer
path does no checking at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from services.engine.attention.base import (
    AttentionLayout,
    AttentionMetadata,
    allocate_plain_kv_cache,
)
from services.engine.attention.windowed import WindowedPlan, build_plan, windowed_attention

# Decode batches at least this large (and float32) use the bag path; see the module docstring.
BAG_PATH_MIN_SEQS = 4


@dataclass(slots=True)
class _BagLayout:
    """Value rows read by ``embedding_bag``, for one head layout (the same for every layer)."""

    num_heads: int
    num_kv_heads: int
    rows: torch.Tensor  # value row (slot * H_kv + kv_head) per (request, head, key < seq_len)
    offsets: torch.Tensor  # [B * H] where each (request, head) bag starts in `rows`
    weight_index: torch.Tensor | None  # those keys' places in the padded [B, H, max_len] scores
    padding: torch.Tensor | None  # [B, 1, max_len] True at padding keys; None when none


@dataclass(slots=True)
class _DecodeGroup:
    """All single-token requests of a step, attended to in one batched call."""

    token_index: torch.Tensor | None  # [B] rows of `query` (None: the batch is all decode)
    block_ids: torch.Tensor  # [B * num_blocks] physical blocks, row-major per request
    num_blocks: int  # blocks gathered per request (enough for the longest)
    seq_lens: torch.Tensor  # [B] int64
    max_len: int  # keys per request after padding is trimmed
    mask: torch.Tensor | None  # [B, 1, 1, max_len] key < seq_len; None when all lengths equal
    tables: torch.Tensor  # [B, num_blocks] int32 block tables (the CPU kernel reads these)
    seq_lens32: torch.Tensor  # [B] int32
    bags: _BagLayout | None = None  # built with the plan when the bag path will run

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(slots=True)
class _PrefillItem:
    """One request with several new tokens, attended to on its own."""

    q_start: int
    q_end: int
    block_ids: torch.Tensor  # [num_blocks] view into the block table
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bottom-right causal; None: plain is_causal


@dataclass(slots=True)
class TokenRows:
    """One kernel row per new token of a step (the CPU backend's paged kernel)."""

    tables: torch.Tensor  # [num_tokens, max_blocks] int32: the token's request's block table
    lens: torch.Tensor  # [num_tokens] int32: cache slots the token attends to (causal)


@dataclass(slots=True)
class StepPlan:
    """A step's attention plan (``meta.plan``): what each path of the backend reads."""

    num_tokens: int
    # The plain causal path: the decode batch and the multi-token requests, or (CPU
    # backend) one kernel row per token; all None when no layer takes the plain path.
    decode: _DecodeGroup | None = None
    prefills: list[_PrefillItem] = field(default_factory=list)
    rows: TokenRows | None = None
    # The windowed path, per effective window (None: the whole context, soft-capped).
    windowed: dict[int | None, WindowedPlan] = field(default_factory=dict)


def effective_window(window: int | None, meta: AttentionMetadata) -> int | None:
    """A window no context of the step reaches past is no window."""
    return None if window is None or meta.max_seqlen_k <= window else window


def layer_paths(meta: AttentionMetadata, layout: AttentionLayout) -> tuple[set, bool]:
    """(the effective windows of the layers that take the windowed path, whether any layer
    takes the plain causal path) for this step."""
    windowed, plain = set(), False
    for window in layout.windows:
        w = effective_window(window, meta)
        if w is None and layout.softcap is None:
            plain = True
        else:
            windowed.add(w)
    return windowed, plain


class TorchAttentionBackend:
    """Paged attention with plain torch ops; works on any device torch supports."""

    name = "torch"

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return allocate_plain_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                       device)

    # ------------------------------------------------------------------ store

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Writes ``key[t]``/``value[t]`` into cache slot ``slot_mapping[t]``; slots < 0 skip."""
        if key.shape[0] == 0:
            return
        slots = slot_mapping.to(torch.int64)
        # Padding tokens (e.g. CUDA-graph filler) carry slot -1 and must not be written.
        valid = slots >= 0
        if not bool(valid.all()):
            key, value, slots = key[valid], value[valid], slots[valid]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))

    # ------------------------------------------------------------------ attention

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of every request's new queries over its whole paged context, or
        over the last ``window`` positions; ``softcap`` caps the scores (``windowed``)."""
        window = effective_window(window, meta)
        plan: StepPlan = meta.plan
        if window is not None or softcap is not None:
            if plan.num_tokens == 0:
                return torch.empty_like(query)
            return windowed_attention(query, k_cache, v_cache, plan.windowed[window], scale,
                                      softcap)
        if plan.num_tokens == 0:
            return torch.empty_like(query)
        if plan.decode is not None and plan.decode.token_index is None:
            return self._decode(query, k_cache, v_cache, plan.decode, scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if plan.decode is not None:
            idx = plan.decode.token_index
            q = query.index_select(0, idx)
            out.index_copy_(0, idx, self._decode(q, k_cache, v_cache, plan.decode, scale))
        for item in plan.prefills:
            out[item.q_start : item.q_end] = _prefill_attention(
                query[item.q_start : item.q_end], k_cache, v_cache, item, scale
            )
        return out

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _DecodeGroup,
        scale: float,
    ) -> torch.Tensor:
        """Attention of the step's single-token requests (``query``: ``[B, H, D]``)."""
        return _decode_attention(query, k_cache, v_cache, group, scale)

    # ------------------------------------------------------------------ plan

    def plan(self, meta: AttentionMetadata, layout: AttentionLayout) -> StepPlan:
        windowed, plain = layer_paths(meta, layout)
        plan = self._windowed_plan(meta, windowed)
        if plain and plan.num_tokens:
            self._plain_plan(plan, meta, layout)
        return plan

    def _windowed_plan(self, meta: AttentionMetadata, windows: set) -> StepPlan:
        num_tokens = sum(meta.query_lens)
        device = meta.block_tables.device
        plans = {w: build_plan(meta, w, device) for w in windows} if num_tokens else {}
        return StepPlan(num_tokens=num_tokens, windowed=plans)

    def _plain_plan(self, plan: StepPlan, meta: AttentionMetadata,
                    layout: AttentionLayout) -> None:
        """The decode batch and the multi-token requests of the plain causal path."""
        # The metadata passed ``contract.check_step`` (lengths, block table width, block size).
        bs, device = meta.block_size, meta.block_tables.device
        tables = meta.block_tables
        decode_rows = [i for i, q_len in enumerate(meta.query_lens) if q_len == 1]
        starts = _cumsum0(meta.query_lens)
        plan.prefills = [
            _prefill_item(tables[i], starts[i], q_len, meta.seq_lens[i], bs, device)
            for i, q_len in enumerate(meta.query_lens)
            if q_len > 1
        ]
        if decode_rows:
            all_decode = len(decode_rows) == meta.num_seqs
            plan.decode = _decode_group(tables, decode_rows, starts, meta.seq_lens, bs,
                                        all_decode, device)
            if layout.dtype == torch.float32 and plan.decode.num_seqs >= BAG_PATH_MIN_SEQS:
                plan.decode.bags = _bag_layout(plan.decode, layout.num_heads,
                                               layout.num_kv_heads, bs)


# ---------------------------------------------------------------------- per-step plan


def _cumsum0(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _decode_group(
    tables: torch.Tensor,
    rows: list[int],
    starts: list[int],
    seq_lens: list[int],
    block_size: int,
    all_decode: bool,
    device: torch.device,
) -> _DecodeGroup:
    lens = [seq_lens[i] for i in rows]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    if all_decode:
        token_index = None
        sub = tables[:, :num_blocks]
    else:
        row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        token_index = torch.tensor([starts[i] for i in rows], dtype=torch.int64, device=device)
        sub = tables.index_select(0, row_index)[:, :num_blocks]
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    mask = None
    if min(lens) != max_len:
        mask = torch.arange(max_len, device=device) < lens_t[:, None]
        mask = mask.view(len(rows), 1, 1, max_len)
    return _DecodeGroup(
        token_index=token_index,
        block_ids=sub.reshape(-1).to(torch.int64),
        num_blocks=num_blocks,
        seq_lens=lens_t,
        max_len=max_len,
        mask=mask,
        tables=sub.to(torch.int32),
        seq_lens32=lens_t.to(torch.int32),
    )


def _bag_layout(
    group: _DecodeGroup, num_heads: int, num_kv_heads: int, block_size: int
) -> _BagLayout:
    num_seqs, max_len = group.num_seqs, group.max_len
    device = group.block_ids.device
    offsets_in_block = torch.arange(block_size, device=device)
    slots = group.block_ids.view(num_seqs, group.num_blocks, 1) * block_size + offsets_in_block
    slots = slots.view(num_seqs, -1)[:, :max_len]
    kv_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
    rows = slots[:, None, :] * num_kv_heads + kv_head[None, :, None]  # [B, H, max_len]
    bag_sizes = group.seq_lens.repeat_interleave(num_heads)
    weight_index = padding = None
    if group.mask is None:
        rows = rows.reshape(-1)
    else:
        padding = ~group.mask.view(num_seqs, 1, max_len)
        # Ragged: drop padding keys, so padding value rows are never read.
        keep = group.mask.view(num_seqs, 1, max_len).expand(num_seqs, num_heads, max_len)
        weight_index = torch.arange(keep.numel(), device=device).view(keep.shape)[keep]
        rows = rows[keep]
    return _BagLayout(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        rows=rows,
        offsets=torch.cumsum(bag_sizes, 0) - bag_sizes,
        weight_index=weight_index,
        padding=padding,
    )


def _prefill_item(
    table_row: torch.Tensor,
    q_start: int,
    q_len: int,
    seq_len: int,
    block_size: int,
    device: torch.device,
) -> _PrefillItem:
    mask = None
    if q_len != seq_len:
        # Query j sits at absolute position seq_len - q_len + j and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
    return _PrefillItem(
        q_start=q_start,
        q_end=q_start + q_len,
        block_ids=table_row[: -(-seq_len // block_size)].to(torch.int64),
        seq_len=seq_len,
        mask=mask,
    )


# ---------------------------------------------------------------------- compute


def _decode_attention(
    query: torch.Tensor,  # [B, H, D], one token per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
) -> torch.Tensor:
    if query.dtype == torch.float32 and group.num_seqs >= BAG_PATH_MIN_SEQS:
        return _decode_attention_bags(query, k_cache, v_cache, group, scale)
    return _decode_attention_sdpa(query, k_cache, v_cache, group, scale)


def _decode_attention_bags(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    bags = group.bags  # built with the plan (the bag path is float32 and >= 4 requests)
    keys = k_cache.index_select(0, group.block_ids).view(num_seqs, -1, num_kv_heads * head_dim)
    keys = keys[:, : group.max_len]
    # [B, H_kv, g, H_kv, D], non-zero only where the two H_kv indices agree.
    q_bd = query.new_zeros(num_seqs, num_kv_heads, group_size, num_kv_heads, head_dim)
    # The scale goes on the queries: B*H*D multiplies instead of B*H*max_len.
    q = query.reshape(num_seqs, num_kv_heads, group_size, head_dim) * scale
    q_bd.diagonal(dim1=1, dim2=3).copy_(q.permute(0, 2, 3, 1))
    q_bd = q_bd.view(num_seqs, num_heads, num_kv_heads * head_dim)
    scores = torch.bmm(q_bd, keys.transpose(1, 2))  # [B, H, max_len]
    if bags.padding is not None:
        scores.masked_fill_(bags.padding, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(-1)
    if bags.weight_index is not None:
        probs = probs.index_select(0, bags.weight_index)
    out = F.embedding_bag(
        bags.rows, v_cache.view(-1, head_dim), bags.offsets, mode="sum", per_sample_weights=probs
    )
    return out.view(num_seqs, num_heads, head_dim)


def _decode_attention_sdpa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    padded = group.num_blocks * block_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # One index op for the whole batch; the transpose is a view (SDPA takes strides).
        kv = cache.index_select(0, group.block_ids).view(num_seqs, padded, num_kv_heads, head_dim)
        return kv[:, : group.max_len].transpose(1, 2)

    # Query heads h*g .. h*g+g-1 share KV head h: view them as a g-long query "sequence".
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k, v = gather(k_cache), gather(v_cache)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,  # [q_len, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    item: _PrefillItem,
    scale: float,
) -> torch.Tensor:
    q_len, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads

    def gather(cache: torch.Tensor) -> torch.Tensor:
        kv = cache.index_select(0, item.block_ids).view(-1, num_kv_heads, head_dim)
        # [H_kv, group, L, D] with a zero stride over the group: GQA without copying KV heads
        # (SDPA's own enable_gqa drops to the slow math kernel on the CPU).
        kv = kv[: item.seq_len].permute(1, 0, 2).unsqueeze(1)
        return kv.expand(num_kv_heads, group, item.seq_len, head_dim)

    q = query.reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    out = F.scaled_dot_product_attention(
        q,
        gather(k_cache),
        gather(v_cache),
        attn_mask=item.mask,
        is_causal=item.mask is None,
        scale=scale,
    )
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
