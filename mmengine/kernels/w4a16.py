"""W4A16 GEMM: y = x @ W^T with W stored as 4-bit integers, dequantized in registers.

The weight layout is the one every supported int4 format normalises to at load (GPTQ's, with zero
points unpacked): `qweight` int32 [K / 8, N], nibble i of word r holding W^T[8r + i, n] in 0..15;
`scales` and `zeros` [K / group, N] in the activations' dtype, W^T[k, n] = (q - zeros[k / group, n]) x
scales[k / group, n]. GPTQ's act-order checkpoints assign inputs to groups out of order: then
`g_idx` [K] gives each input's group instead of k / group. A tile of K loads each packed word once per nibble it needs (the repeats hit the
cache), shifts out its nibbles, dequantizes them in fp32 and multiplies on the tensor cores: the weight
is read from memory at 4 bits, the point of the format for a decode step bound by weight reads.
Decode-shaped steps use 16-row tiles, prefill-shaped ones 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import dot_precision, launch_options


@triton.jit
def _w4a16_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_qk, stride_sg, stride_om,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_G_IDX: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        words = tl.load(qweight_ptr + (ks // 8)[:, None] * stride_qk + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0)
        q = (words >> ((ks % 8) * 4)[:, None]) & 0xF
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + ks, mask=k_ok, other=0)
        else:
            groups = ks // group_size
        scale = tl.load(scales_ptr + groups[:, None] * stride_sg + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        zero = tl.load(zeros_ptr + groups[:, None] * stride_sg + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        w = ((q.to(tl.float32) - zero.to(tl.float32)) * scale.to(tl.float32)).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32) @ the dequantized weight^T -> [M, N] in x's dtype; g_idx [K] int32
    (act-order) gives each input's group."""
    m, k = x.shape
    n = qweight.shape[1]
    if k % 8 or qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not pack K = {k} inputs 8 to a word")
    if scales.shape != zeros.shape or scales.shape != (-(-k // group_size), n):
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not cover K = {k} in groups of {group_size}")
    if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32):
        raise ValueError(f"g_idx {tuple(g_idx.shape)} {g_idx.dtype} is not one int32 group per input (K = {k})")
    assert x.stride(-1) == 1 and qweight.stride(-1) == 1 and scales.stride(-1) == 1 and zeros.stride() == scales.stride()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    block_n = max(16, min(128, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    _w4a16_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, zeros, qweight if g_idx is None else g_idx, out, m, n, k, group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        PRECISION=dot_precision(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_G_IDX=g_idx is not None, **launch_options(num_stages=3 if block_m == 64 else 2),
    )
    return out
