"""Writing K/V into an FP8 (e4m3) cache: x * inv_scale, saturated to ±448, rounded to nearest even.

The rounding is done here in fp32 bit arithmetic, so the final cast only converts values e4m3 holds
exactly: every backend then stores the same bits as `torch.Tensor.to(torch.float8_e4m3fn)` (Triton's
interpreter, and software conversions on GPUs without FP8 units, round differently at exponent
boundaries). Caches in the model dtype take the plain cast. Readers cast the loaded FP8 values to the
query's dtype (exact) and apply the scales outside the kernels: the key scale joins the softmax
scale, the value scale multiplies the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.e4m3 import float_to_e4m3_bits

E4M3_MAX = 448.0
_MAX: tl.constexpr = tl.constexpr(E4M3_MAX)
_MIN_NORMAL: tl.constexpr = tl.constexpr(0.015625)  # 2**-6: below it e4m3 is subnormal, with a fixed step of 2**-9


def is_fp8(dtype: torch.dtype) -> bool:
    """An FP8 cache: e4m3, or its bits (uint8) where Triton has no e4m3 type (kernels/e4m3.py)."""
    return dtype in (torch.float8_e4m3fn, torch.uint8)


def quantize_e4m3(x: torch.Tensor, inv_scale: float) -> torch.Tensor:
    """The PyTorch form: x * inv_scale in fp32, saturated, cast."""
    return (x.float() * inv_scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


@triton.jit
def _round_mantissa_to_3_bits(x):
    """Rounds a normal fp32 to 3 mantissa bits, ties to even (the carry may move the exponent: right)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # clear the low 20 of 23 mantissa bits
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_cache(x, inv_scale, cache_dtype: tl.constexpr, FP8: tl.constexpr):
    """x (any float dtype) as the cache stores it."""
    if FP8:
        y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -_MAX), _MAX)
        magnitude = tl.abs(y)
        normal = _round_mantissa_to_3_bits(magnitude)
        # subnormals are multiples of 2**-9: adding 2**23 to magnitude * 2**9 rounds it to an integer, once
        subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
        rounded = tl.where(magnitude < _MIN_NORMAL, subnormal, normal)
        negative = y.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 stays -0.0, as torch's cast keeps it
        exact = tl.where(negative, -rounded, rounded)
        if tl.constexpr(cache_dtype == tl.uint8):
            stored = float_to_e4m3_bits(exact)
        else:
            stored = exact.to(cache_dtype)
        return stored
    else:
        return x.to(cache_dtype)
