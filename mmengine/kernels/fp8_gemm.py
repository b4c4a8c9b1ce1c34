"""FP8 weight GEMM: y = x @ W^T with W stored in e4m3 and scaled per block, dequantized in registers.

Every FP8 format normalises to one layout at load: `weight` e4m3 [N, K] as the checkpoint stores it, and
`scales` fp32 [N, ceil(K / group_k)], W[n, k] = weight[n, k] x scales[n, k // group_k]. Qwen's 128 x 128
blocks repeat each block's scale over its 128 rows; a per-channel scale is group_k = K; a per-tensor
one is that scale in every row. A K tile loads its e4m3 weights (half of bf16's bytes: the point for a
decode step bound by weight reads), dequantizes them in fp32 to the activations' dtype (the same
values a dequantize-at-load model holds) and multiplies on the tensor cores. Decode-shaped steps use
16-row tiles, prefill-shaped ones 64. Before compute capability 8.9 (Triton's e4m3 type) the weights are
read as their bits and decoded in integer arithmetic (`e4m3_bits_to_float`, exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.e4m3 import e4m3_bits_to_float, e4m3_for_triton
from mmengine.kernels.weight_gemm import launch_weight_gemm, load_activations, output_tile, store_output


@triton.jit
def load_fp8_tile(weight_ptr, scales_ptr, ks, cols, mask, stride_wn, stride_sn, group_k, dtype):
    """The tile W^T[ks, cols] dequantized to `dtype`."""
    scale = tl.load(scales_ptr + cols[None, :] * stride_sn + (ks // group_k)[:, None], mask=mask, other=0.0)
    at = weight_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    if tl.constexpr(weight_ptr.dtype.element_ty == tl.uint8):  # the e4m3 bits, where Triton has no e4m3 type
        w = e4m3_bits_to_float(tl.load(at, mask=mask, other=0))
    else:
        w = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    return (w * scale).to(dtype)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, weight_ptr, scales_ptr, out_ptr,
    M, N, K, group_k,
    stride_xm, stride_wn, stride_sn, stride_om,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows, cols, row_ok, col_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        tile_ok = k_ok[:, None] & col_ok[None, :]
        a = load_activations(x_ptr, rows, ks, row_ok, k_ok, stride_xm)
        w = load_fp8_tile(weight_ptr, scales_ptr, ks, cols, tile_ok, stride_wn, stride_sn, group_k, a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    store_output(out_ptr, acc, rows, cols, row_ok, col_ok, stride_om)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_k: int) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32) @ (weight [N, K] e4m3 x scales [N, ceil(K / group_k)])^T -> [M, N] in x's dtype.
    `weight` may also be its bits (uint8), decoded in integer arithmetic: the path GPUs before compute
    capability 8.9 take (Triton's e4m3 type needs 8.9)."""
    k = x.shape[1]
    n = weight.shape[0]
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8) or weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} is not an e4m3 [N, {k}] matrix")
    weight = e4m3_for_triton(weight)
    if scales.shape != (n, -(-k // group_k)) or scales.dtype != torch.float32:
        raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype} do not cover [{n}, {k}] in fp32 groups of {group_k} inputs")
    assert weight.stride(-1) == 1 and scales.stride(-1) == 1
    return launch_weight_gemm(_fp8_gemm_kernel, x, n, (weight, scales), group_k, (weight.stride(0), scales.stride(0)),
                              weight.element_size() + scales.element_size())

