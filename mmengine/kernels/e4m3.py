"""e4m3 as bits: where Triton has no e4m3 type (compute capability below 8.9), FP8 tensors are read and
written as uint8 and converted in integer arithmetic, exactly.

Decoding shifts sign, exponent and mantissa into an fp16's fields (its exponent bias is 8 more, so the
result is scaled by 2^8), subnormals included. Encoding takes a float32 that e4m3 holds exactly (the
callers round first: kernels/kv_quant.py) and packs its fields.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import has_fp8_type


def e4m3_for_triton(tensor: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as this device's kernels read it: itself, or its bits where Triton has no e4m3 type."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn and not has_fp8_type(tensor.device) else tensor


@triton.jit
def e4m3_bits_to_float(bits):
    """e4m3 bits (uint8) -> fp32, exactly."""
    b = bits.to(tl.uint16)
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 256.0


@triton.jit
def float_to_e4m3_bits(y):
    """A float32 that e4m3 holds exactly (saturated and rounded) -> its e4m3 bits (uint8); -0.0 keeps its sign."""
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    magnitude = tl.abs(y)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 0x7)  # exponent re-biased from 127 to 7
    subnormal = (magnitude * 512.0).to(tl.int32)  # multiples of 2^-9 below 2^-6
    return (sign | tl.where(magnitude < 0.015625, subnormal, normal)).to(tl.uint8)
