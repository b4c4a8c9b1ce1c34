"""The FP8 weight GEMM (kernels/fp8_gemm.py) equals the dequantize-at-load path (models/quantization.py's
dequantize_fp8, then a matmul) in Triton's interpreter (compiled on a GPU), for each FP8 layout (block
scales of any shape, per channel, per tensor) over odd shapes and decode- and prefill-shaped row counts,
fp32 and fp16; reading the weights as e4m3 or as their bits (the path before compute capability 8.9)."""

from __future__ import annotations

import pytest
import torch

from mmengine.kernels.fp8_gemm import fp8_matmul
from mmengine.models.quantization import WeightQuantization, dequantize_fp8, fp8_for_kernel

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
OLD_GPU = CUDA and torch.cuda.get_device_capability() < (8, 9)


def _case(m: int, k: int, n: int, spec: WeightQuantization, per_tensor: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if spec.block is not None:
        shape = (-(-n // spec.block[0]), -(-k // spec.block[1]))
    else:
        shape = (1,) if per_tensor else (n, 1)
    return torch.randn(m, k, generator=gen).to(dtype), weight, torch.rand(shape, generator=gen) * 1e-3 + 1e-4


BLOCKS = WeightQuantization("fp8", "weight_scale_inv", (128, 128))
LAYOUTS = [  # (spec, one scale for the whole tensor)
    pytest.param(BLOCKS, False, id="block128"),
    pytest.param(WeightQuantization("fp8", "weight_scale_inv", (16, 24)), False, id="block16x24"),
    pytest.param(WeightQuantization("compressed-tensors"), False, id="channel"),
    pytest.param(WeightQuantization("compressed-tensors"), True, id="tensor"),
]


@pytest.mark.parametrize("bits", [False, True], ids=["e4m3", "bits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("spec,per_tensor", LAYOUTS)
@pytest.mark.parametrize("m,k,n", [(1, 64, 24), (5, 40, 72), (70, 200, 48), (17, 136, 130)])
def test_the_kernel_equals_dequantize_then_matmul(m, k, n, spec, per_tensor, dtype, bits):
    if OLD_GPU and not bits:
        pytest.skip("Triton's e4m3 type needs compute capability 8.9+; fp8_matmul reads the bits here (the `bits` cases)")
    x, weight, scale = _case(m, k, n, spec, per_tensor, dtype, seed=m * 31 + n)
    dense = dequantize_fp8(weight, scale, spec, "w").to(dtype)  # what a dequantize-at-load model holds
    expected = x.float() @ dense.float().t()
    packed = fp8_for_kernel(weight, scale, spec)
    stored = packed.weight.view(torch.uint8) if bits else packed.weight
    got = fp8_matmul(x.to(DEVICE), stored.to(DEVICE), packed.scales.to(DEVICE), packed.group_k)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float().cpu(), expected, **tolerance)
    assert got.dtype == dtype


def test_bad_layouts_are_named():
    spec = WeightQuantization("fp8", "weight_scale_inv", (16, 16))
    x, weight, scale = _case(2, 64, 32, spec, False, torch.float32, 0)
    packed = fp8_for_kernel(weight, scale, spec)
    with pytest.raises(ValueError, match="is not an e4m3"):
        fp8_matmul(x, packed.weight.float(), packed.scales, 16)
    with pytest.raises(ValueError, match="do not cover"):
        fp8_matmul(x, packed.weight, packed.scales, 8)


def test_the_bits_decode_every_e4m3_value_exactly():
    """Every e4m3 bit pattern but the two NaNs (subnormals, ±0 and ±448 included), read as bits and
    decoded in integer arithmetic, is the value torch's e4m3 holds: an identity matrix times the weights."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8).view(2, 127)
    eye = torch.eye(127, dtype=torch.float32, device=DEVICE)
    got = fp8_matmul(eye, codes.to(DEVICE), torch.ones(2, 1, device=DEVICE), 127)
    assert torch.equal(got.cpu(), codes.view(torch.float8_e4m3fn).float().t())
