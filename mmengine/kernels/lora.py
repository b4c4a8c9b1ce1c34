"""Segmented LoRA matmul (the SGMV pattern): `out[rows] (+)= inp[rows] @ weights[slot].T` for each
segment of consecutive rows that share one adapter slot.

A LoRA delta is two of these: shrink (`x @ A[slot].T`, hidden -> rank) then expand with
accumulation into the base projection's output (`s @ B[slot].T`, rank -> out features). A step's
rows are packed request by request, so each request's rows are one segment and no sorting is
needed. Rows outside every segment (base-model requests) are not touched, nor are segments on slot
-1 (a decode CUDA graph has one fixed segment per row and marks the rows without an adapter so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import GemmTiles, dot_precision, fit_gemm_tiles, launch_options, shared_memory_limit


@triton.jit
def _segmented_matmul_kernel(
    inp_ptr, weight_ptr, out_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    N, K,
    stride_in_m, stride_w_slot, stride_w_n, stride_w_k, stride_out_m,
    ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    length = tl.where(slot >= 0, length, 0)  # slot -1: rows without an adapter (a CUDA graph's fixed segments)
    row_ok = rows < length
    col_ok = cols < N
    row_index = (start + rows).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(inp_ptr + row_index[:, None] * stride_in_m + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            weight_ptr + slot * stride_w_slot + cols[None, :] * stride_w_n + ks[:, None] * stride_w_k,
            mask=k_ok[:, None] & col_ok[None, :], other=0.0,
        )
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    out = out_ptr + row_index[:, None] * stride_out_m + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def lora_tiles(max_seg_len: int, n: int, k: int, act_bytes: int, weight_bytes: int, limit: int) -> GemmTiles:
    """The launch configuration for segments of up to `max_seg_len` rows [k] (`act_bytes` an element) @
    weights [n, k] (`weight_bytes` an element) within `limit` bytes of shared memory."""
    block_m = 16 if max_seg_len <= 16 else 64
    block_n = 64 if n <= 64 else 128
    block_k = 32 if k <= 32 else 64
    return fit_gemm_tiles(block_m, block_n, block_k, 3, act_bytes, weight_bytes, limit)


def segmented_matmul(
    inp: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    accumulate: bool,
) -> None:
    """inp [T, K], weights [slots, N, K], out [T, N] (rows contiguous); segments as int32 tensors on
    inp's device, with `max_seg_len` their longest length (the grid's row extent)."""
    num_segments = seg_starts.shape[0]
    n, k = weights.shape[1], weights.shape[2]
    if num_segments == 0 or max_seg_len == 0:
        return
    assert inp.stride(1) == 1 and out.stride(1) == 1 and weights.stride(2) == 1
    tiles = lora_tiles(max_seg_len, n, k, inp.element_size(), weights.element_size(), shared_memory_limit(inp.device))
    grid = (num_segments, triton.cdiv(max_seg_len, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _segmented_matmul_kernel[grid](
        inp, weights, out, seg_starts, seg_lens, seg_slots,
        n, k,
        inp.stride(0), weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0),
        ACCUMULATE=accumulate, PRECISION=dot_precision(inp.dtype),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        **launch_options(num_stages=tiles.num_stages),
    )

