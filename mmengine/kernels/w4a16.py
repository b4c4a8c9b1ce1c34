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

from mmengine.kernels.weight_gemm import launch_weight_gemm, load_activations, output_tile, store_output


@triton.jit
def load_int4_tile(qweight_ptr, scales_ptr, zeros_ptr, ks, cols, groups, mask, stride_qk, stride_sg, dtype):
    """The tile W^T[ks, cols] dequantized to `dtype` (inputs `ks` in groups `groups`)."""
    words = tl.load(qweight_ptr + (ks // 8)[:, None] * stride_qk + cols[None, :], mask=mask, other=0)
    q = (words >> ((ks % 8) * 4)[:, None]) & 0xF
    scale = tl.load(scales_ptr + groups[:, None] * stride_sg + cols[None, :], mask=mask, other=0.0)
    zero = tl.load(zeros_ptr + groups[:, None] * stride_sg + cols[None, :], mask=mask, other=0.0)
    return ((q.to(tl.float32) - zero.to(tl.float32)) * scale.to(tl.float32)).to(dtype)


@triton.jit
def _w4a16_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_qk, stride_sg, stride_om,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_G_IDX: tl.constexpr,
):
    rows, cols, row_ok, col_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = load_activations(x_ptr, rows, ks, row_ok, k_ok, stride_xm)
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + ks, mask=k_ok, other=0)
        else:
            groups = ks // group_size
        w = load_int4_tile(qweight_ptr, scales_ptr, zeros_ptr, ks, cols, groups, k_ok[:, None] & col_ok[None, :], stride_qk, stride_sg,
                           a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    store_output(out_ptr, acc, rows, cols, row_ok, col_ok, stride_om)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32) @ the dequantized weight^T -> [M, N] in x's dtype; g_idx [K] int32
    (act-order) gives each input's group."""
    k = x.shape[1]
    n = qweight.shape[1]
    if k % 8 or qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not pack K = {k} inputs 8 to a word")
    if scales.shape != zeros.shape or scales.shape != (-(-k // group_size), n):
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not cover K = {k} in groups of {group_size}")
    if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32):
        raise ValueError(f"g_idx {tuple(g_idx.shape)} {g_idx.dtype} is not one int32 group per input (K = {k})")
    assert qweight.stride(-1) == 1 and scales.stride(-1) == 1 and zeros.stride() == scales.stride()
    return launch_weight_gemm(_w4a16_kernel, x, n, (qweight, scales, zeros, qweight if g_idx is None else g_idx), group_size,
                              (qweight.stride(0), scales.stride(0)), qweight.element_size() + scales.element_size() + zeros.element_size(),
                              HAS_G_IDX=g_idx is not None)
