"""What the GEMMs over weights dequantized in registers (w4a16.py, fp8_gemm.py) share: the output tile a
program owns, the activation tile it loads per step of K, the store, and the launch (16-row tiles for
decode-shaped steps, 64 for prefill-shaped ones; K tiles of 128 bytes of activations per row, so fp32 takes
half the inputs of a 16-bit type; as many pipeline stages as the device's shared memory holds). Each kernel
supplies only its weight tile's decoding.

Kernel argument order: x, the weight tensors, out, M, N, K, the group size, x's row stride, the weight
tensors' strides, out's row stride, then the constexprs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import K_TILE_BYTES, GemmTiles, dot_precision, fit_gemm_tiles, launch_options, shared_memory_limit


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output rows and columns, and which of them exist."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def load_activations(x_ptr, rows, ks, row_ok, k_ok, stride_xm):
    return tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def store_output(out_ptr, acc, rows, cols, row_ok, col_ok, stride_om):
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def weight_gemm_tiles(m: int, n: int, k: int, act_bytes: int, weight_bytes: int, limit: int) -> GemmTiles:
    """The launch configuration for x [m, k] (`act_bytes` an element) @ W^T [k, n], where the kernel loads
    `weight_bytes` per weight element (packed values, scales and zero points together), within `limit`
    bytes of shared memory."""
    block_m = 16 if m <= 16 else 64
    block_n = max(16, min(128, triton.next_power_of_2(n)))
    block_k = max(16, min(K_TILE_BYTES // act_bytes, triton.next_power_of_2(k)))
    return fit_gemm_tiles(block_m, block_n, block_k, 3 if block_m == 64 else 2, act_bytes, weight_bytes, limit)


def launch_weight_gemm(kernel: triton.JITFunction, x: torch.Tensor, n: int, weights: tuple[torch.Tensor, ...], group: int,
                       weight_strides: tuple[int, ...], weight_bytes: int, **constexprs: object) -> torch.Tensor:
    """x [M, K] @ the kernel's dequantized weight^T -> [M, n] in x's dtype; the kernel loads `weight_bytes`
    per weight element."""
    m, k = x.shape
    assert x.stride(-1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = weight_gemm_tiles(m, n, k, x.element_size(), weight_bytes, shared_memory_limit(x.device))
    kernel[(triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))](
        x, *weights, out, m, n, k, group, x.stride(0), *weight_strides, out.stride(0),
        PRECISION=dot_precision(x.dtype), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **constexprs,
        **launch_options(num_stages=tiles.num_stages),
    )
    return out
