"""The FP8 weight GEMM (kernels/fp8_gemm.py) equals the dequantize-at-load path (models/quantization.py's
dequantize_fp8, then a matmul) in Triton's interpreter (compiled on a GPU of compute capability 8.9+),
for each FP8 layout (block scales of any shape, per channel, per tensor) over odd shapes and
decode- and prefill-shaped row counts, fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from mmengine.kernels.fp8_gemm import fp8_matmul
from mmengine.models.quantization import WeightQuantization, dequantize_fp8, fp8_for_kernel

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() < (8, 9),
                                reason="e4m3 needs compute capability 8.9+ in Triton; the interpreter on CPU checks the same")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("spec,per_tensor", LAYOUTS)
@pytest.mark.parametrize("m,k,n", [(1, 64, 24), (5, 40, 72), (70, 200, 48), (17, 136, 130)])
def test_the_kernel_equals_dequantize_then_matmul(m, k, n, spec, per_tensor, dtype):
    x, weight, scale = _case(m, k, n, spec, per_tensor, dtype, seed=m * 31 + n)
    dense = dequantize_fp8(weight, scale, spec, "w").to(dtype)  # what a dequantize-at-load model holds
    expected = x.float() @ dense.float().t()
    packed = fp8_for_kernel(weight, scale, spec)
    got = fp8_matmul(x.to(DEVICE), packed.weight.to(DEVICE), packed.scales.to(DEVICE), packed.group_k)
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
