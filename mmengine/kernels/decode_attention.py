"""Paged decode attention with split-KV.

Stage 1: for each (request, KV head, split), the GROUP query heads of that KV head attend to one
contiguous slice of the request's context, read through its block table, and write a partial
state (normalized output, lse). Stage 2 merges a request's splits through their log-sum-exps.
Splitting puts several programs on one long context, so a small batch still fills the GPU.

With a sliding window W a request attends to its last W keys, [seq_len - W, seq_len): the splits
cut that range alone (from the tile holding its first key), so a long context costs what its window
costs. With attention chunks of C tokens it attends to [floor((seq_len - 1) / C) * C, seq_len), alike.
A split left with no keys writes the empty state (lse -inf), which the reduction weighs 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import launch_options, LOG2E, dot_precision, kernel_chunk, kernel_window, padded_head_dim
from mmengine.kernels.online_softmax import attend_tile, finish, load_kv_tile
from mmengine.kernels.e4m3 import e4m3_for_triton


@triton.jit(do_not_specialize=["window", "chunk"])  # per layer: one compiled kernel for every window and chunk
def _decode_split_kernel(
    q_ptr, cache_ptr, part_out_ptr, part_lse_ptr,
    seq_lens_ptr, block_tables_ptr,
    window, chunk, qk_scale,
    stride_qt, stride_qh,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    first = tl.maximum(tl.maximum(seq_len - window, 0), tl.maximum(seq_len - 1, 0) // chunk * chunk)  # the first key seen
    base = first // BLOCK_N * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(seq_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = base + split * split_len
    end = tl.minimum(seq_len, start + split_len)
    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(q_ptr + req * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        n_valid = (n < end) & (n >= first)
        k, v = load_kv_tile(cache_ptr, block_tables_ptr, req, n, n_valid, kv_head, d, d_valid,
                            stride_bt, stride_ckv, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        m_i, l_i, acc = attend_tile(q, k, v, n_valid[None, :], m_i, l_i, acc, qk_scale, PRECISION)
    out, lse = finish(acc, m_i, l_i)
    part = req * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :]
    tl.store(part_out_ptr + part, out.to(part_out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    tl.store(part_lse_ptr + req * stride_lt + head * stride_lh + split, lse, mask=row_valid)


# Elements of the [rows, splits, head_dim] tile one reduction program holds: a row is one (request, query head),
# several to a program where splits x head_dim are few.
_REDUCE_TILE_ELEMENTS = 1024
_MAX_REDUCE_ROWS_PER_PROGRAM = 64


@triton.jit(do_not_specialize=["num_rows"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_rows,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh, stride_ft, stride_fh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """Rows (request * NUM_HEADS + head) [b * BLOCK_ROWS, (b + 1) * BLOCK_ROWS) in program b."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_valid = rows < num_rows
    req = rows // NUM_HEADS
    head = rows % NUM_HEADS
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    lse_rows = (req * stride_lt + head * stride_lh)[:, None] + splits[None, :]
    lse = tl.load(part_lse_ptr + lse_rows, mask=row_valid[:, None], other=float("-inf"))  # [BLOCK_ROWS, NUM_SPLITS]
    m = tl.max(lse, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe[:, None])  # 0 for empty splits
    total = tl.sum(w, 1)
    parts_rows = (req * stride_pt + head * stride_ph)[:, None, None] + splits[None, :, None] * stride_ps + d[None, None, :]
    parts = tl.load(part_out_ptr + parts_rows, mask=row_valid[:, None, None] & d_valid[None, None, :], other=0.0)
    out = tl.sum(parts * w[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]
    out_rows = (req * stride_ot + head * stride_oh)[:, None] + d[None, :]
    tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    tl.store(lse_ptr + req * stride_ft + head * stride_fh,
             tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf")), mask=row_valid)


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int = 32,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [reqs, q_heads, D], one token per request attending to its whole context of seq_lens keys
    (with `window`, to its last `window` keys; with `chunk`, to those of its own chunk). Returns (out [reqs, q_heads, D] and lse [reqs, q_heads]
    fp32 natural log, -inf for a context of zero), written into `out` and `lse` when given."""
    kv_cache = e4m3_for_triton(kv_cache)
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    out = torch.empty_like(query) if out is None else out
    lse = torch.empty(num_reqs, num_heads, device=query.device, dtype=torch.float32) if lse is None else lse
    if num_reqs == 0:
        return out, lse
    block_d = padded_head_dim(head_dim)
    if num_splits == 1:
        # One split is the whole answer: it writes the output and lse directly, no reduction launch.
        part_out, part_lse = out[:, :, None, :], lse[:, :, None]
    else:
        part_out = torch.empty(num_reqs, num_heads, num_splits, block_d, device=query.device, dtype=torch.float32)
        part_lse = torch.empty(num_reqs, num_heads, num_splits, device=query.device, dtype=torch.float32)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        query, kv_cache, part_out, part_lse, seq_lens, block_tables,
        kernel_window(window), kernel_chunk(chunk), scale * LOG2E,
        query.stride(0), query.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), NUM_SPLITS=num_splits, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=block_d, PRECISION=dot_precision(query.dtype),
        **launch_options(),
    )
    if num_splits == 1:
        return out, lse
    num_rows = num_reqs * num_heads
    block_rows = max(1, min(_MAX_REDUCE_ROWS_PER_PROGRAM, _REDUCE_TILE_ELEMENTS // (num_splits * block_d)))
    _decode_reduce_kernel[(triton.cdiv(num_rows, block_rows),)](
        part_out, part_lse, out, lse, num_rows,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_ROWS=block_rows,
        **launch_options(),
    )
    return out, lse
