"""Varlen prefill over a paged prefix.

Queries of many requests are packed together. Each request's new tokens attend causally to
themselves and fully to its cached context; every key (cached or new) is read from the paged
cache through the request's block table, so the step's K/V must be stored first.

One program handles BLOCK_Q query tokens of one request for one KV head. Its rows are
(token, query head) pairs for the GROUP query heads sharing that KV head, so each K/V tile is
loaded once for the whole group (GQA). A group that is not a power of two (7 for 28 query heads
over 4 KV heads) is padded to one with masked rows.

Beyond causal: with a sliding window W the query at position q sees keys k > q - W only, with
attention chunks of C tokens keys k >= floor(q / C) * C only, and the program starts at the tile
holding its first row's earliest key (tiles left of every row's window or chunk are never read); with span ends (one absolute position per new token, >= its own) a row sees keys
up to its span end instead of its own position, and the program reads up to its last token's span
end, the largest of its rows (span ends never decrease along a request: each is its token's own
position or the end of the contiguous run holding it). Each element is masked by its row's bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import launch_options, LOG2E, dot_precision, padded_head_dim, kernel_chunk, kernel_window
from mmengine.kernels.online_softmax import attend_tile, finish, load_kv_tile
from mmengine.kernels.e4m3 import e4m3_for_triton


# first_req varies per step, the window and the chunk per layer: one compiled kernel for all
@triton.jit(do_not_specialize=["first_req", "window", "chunk"])
def _prefill_kernel(
    q_ptr, cache_ptr, out_ptr, lse_ptr,
    query_start_ptr, seq_lens_ptr, block_tables_ptr, span_ends_ptr,
    first_req, window, chunk, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    HAS_SPANS: tl.constexpr,
):
    req = first_req + tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len
        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        token = q_block * BLOCK_Q + rows // GROUP_PAD
        head_in_group = rows % GROUP_PAD
        head = kv_head * GROUP + head_in_group
        row_valid = (token < q_len) & (head_in_group < GROUP)
        q_pos = context_len + token
        d = tl.arange(0, BLOCK_D)
        d_valid = d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_valid[:, None] & d_valid[None, :], other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        tile_end = tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # past the tile's last token
        if HAS_SPANS:
            last = tl.load(span_ends_ptr + q_start + token, mask=row_valid, other=0)
            # span ends never decrease along a request (runs are contiguous): the tile's last token has the
            # largest (a scalar load; a reduction over the rows costs ~50 registers)
            kv_end = tl.minimum(seq_len, tl.load(span_ends_ptr + q_start + tile_end - 1) + 1)
        else:
            last = q_pos
            kv_end = tl.minimum(seq_len, context_len + tile_end)
        first = tl.maximum(q_pos - window + 1, q_pos // chunk * chunk)  # each row's earliest key
        first_row = context_len + q_block * BLOCK_Q  # the earliest key of every row is its first row's or later
        kv_start = tl.maximum(tl.maximum(first_row - window + 1, first_row // chunk * chunk), 0) // BLOCK_N * BLOCK_N
        for start_n in range(kv_start, kv_end, BLOCK_N):
            n = start_n + tl.arange(0, BLOCK_N)
            n_valid = n < kv_end
            k, v = load_kv_tile(cache_ptr, block_tables_ptr, req, n, n_valid, kv_head, d, d_valid,
                                stride_bt, stride_ckv, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            visible = n_valid[None, :] & (n[None, :] <= last[:, None]) & (n[None, :] >= first[:, None])
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION)
        out, lse = finish(acc, m_i, l_i)
        out_rows = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(out_ptr + out_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
        tl.store(lse_ptr + (q_start + token) * stride_lt + head * stride_lh, lse, mask=row_valid)


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    first_req: int = 0,
    num_reqs: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_q: int | None = None,
    block_n: int = 32,
    window: int | None = None,
    span_ends: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [tokens, q_heads, D] packed by query_start_loc [reqs + 1]; attends requests
    [first_req, first_req + num_reqs) (default: all), whose longest query is max_query_len.
    With `window` a query at q sees keys k > q - window only, with `chunk` keys k >= q // chunk * chunk only; with `span_ends` ([tokens] int32,
    absolute positions, each token's at least its own and within its context, never decreasing
    along a request) a token sees keys up to its span end instead of its own position.
    Returns (out [tokens, q_heads, D], lse [tokens, q_heads] natural log); rows of other
    requests are left as they were in `out`/`lse`."""
    kv_cache = e4m3_for_triton(kv_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, "query heads must be a multiple of KV heads"
    if num_reqs is None:
        num_reqs = seq_lens.shape[0] - first_req
    out = torch.empty_like(query) if out is None else out
    lse = torch.full((num_tokens, num_heads), float("-inf"), device=query.device, dtype=torch.float32) if lse is None else lse
    group_pad = triton.next_power_of_2(group)
    if block_q is None:
        block_q = max(1, 64 // group_pad)
    block_q = max(block_q, max(1, 16 // group_pad))  # tl.dot needs at least 16 rows
    if num_reqs == 0 or max_query_len == 0:
        return out, lse
    grid = (num_reqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        query, kv_cache, out, lse,
        query_start_loc, seq_lens, block_tables, seq_lens if span_ends is None else span_ends,
        first_req, kernel_window(window), kernel_chunk(chunk), scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), PRECISION=dot_precision(query.dtype),
        HAS_SPANS=span_ends is not None, **launch_options(),
    )
    return out, lse
