"""W8A8 FP8 GEMM: y = x @ W^T with the activations quantized to e4m3 per token at run time and both
operands multiplied in FP8 by `torch._scaled_mm` (cuBLASLt or CUTLASS on CUDA, compute capability
8.9+; torch's CPU implementation runs it too, which is how it is tested). No Triton here.

Each row of x gets its own scale, amax(|row|) / 448, so the row's largest value lands on e4m3's largest
(saturating: a value rounded past ±448 is clamped, never NaN), as FP8-Dynamic checkpoints declare
(`activation_scheme: "dynamic"`, compressed-tensors' dynamic token-wise `input_activations`). The
weight is the FP8 GEMM's layout (fp8_gemm.py) with one group over all of K: scales [N, 1], a scale
per output channel (per tensor: the same one in every row), applied as `_scaled_mm`'s row-wise
scaling. Block-scaled weights (Qwen's 128 x 128) stay on fp8_gemm.py: torch's block-wise scalings
(1x128 activations x 128x128 weights) run only on CUDA Hopper, and its CPU implementation refuses
them, so they cannot be checked here. Where torch's CPU `_scaled_mm` takes only one scale per operand
(torch 2.11's), the same product is taken from both operands dequantized, multiplied in fp32.
"""

from __future__ import annotations

import functools

import torch

from mmengine.kernels.kv_quant import E4M3_MAX

# an all-zero row gets this amax instead of 0 (its values all quantize to 0 either way)
_MIN_AMAX = 1e-12


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]) with x ~ q x scale, one scale per row."""
    rows = x.float()
    amax = rows.abs().amax(dim=1, keepdim=True).clamp_(min=_MIN_AMAX)
    # A tensor divisor: CUDA divides by a Python number as a multiplication by its fp32 reciprocal, at times
    # one ulp off amax / 448, and that ulp sends near-ties of x / scale to the other e4m3 neighbour.
    scales = amax / torch.full_like(amax, E4M3_MAX)
    return (rows / scales).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scales


@functools.cache
def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether torch's CPU `_scaled_mm` takes a scale per row of its first operand and per column of its
    second, and applies them (torch 2.13 does; 2.11 asserts one scale each)."""
    ones = torch.ones(16, 16).to(torch.float8_e4m3fn)
    scales = torch.arange(1, 17, dtype=torch.float32)
    try:
        got = torch._scaled_mm(ones, ones.t(), scale_a=scales.view(16, 1), scale_b=scales.view(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return torch.equal(got.float(), 16 * scales.view(16, 1) * scales.view(1, 16))  # (exact in bf16)


def w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16 or fp16) @ (weight [N, K] e4m3 x scales fp32 [N, 1])^T -> [M, N] in x's dtype.
    On CUDA K and N must be multiples of 16 (torch._scaled_mm's requirement)."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or x.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} is not an e4m3 [N, {x.shape[1]}] matrix")
    if scales.shape != (n, 1) or scales.dtype != torch.float32:
        raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype}: W8A8 takes one fp32 scale per output channel, [{n}, 1]")
    q, row_scales = quantize_per_token(x)
    if x.device.type == "cpu" and not cpu_scaled_mm_takes_row_scales():
        return ((q.float() * row_scales) @ (weight.float() * scales).t()).to(x.dtype)
    # weight.t() is [K, N] column-major, the layout _scaled_mm wants for its second operand
    return torch._scaled_mm(q, weight.t(), scale_a=row_scales, scale_b=scales.view(1, n), out_dtype=x.dtype)
