"""The W4A16 GEMM (kernels/w4a16.py) equals dequantize-then-matmul in Triton's interpreter (compiled on
a GPU), over odd shapes, decode- and prefill-shaped row counts and group sizes, fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from mmengine.kernels.w4a16 import w4a16_matmul
from mmengine.models.quantization import pack_int4, unpack_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, k: int, n: int, group: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(-(-k // group), n, generator=gen) * 0.05 + 0.01).to(dtype)
    zeros = torch.randint(0, 16, scales.shape, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, pack_int4(q, 0), scales, zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,k,n,group", [(1, 64, 24, 32), (5, 40, 40, 8), (16, 128, 72, 128), (70, 96, 48, 32), (17, 64, 200, 16)])
def test_the_kernel_equals_dequantize_then_matmul(m, k, n, group, dtype):
    x, qweight, scales, zeros = _case(m, k, n, group, dtype, seed=m * 31 + n)
    q = unpack_int4(qweight, 0).float()  # [k, n]
    groups = torch.arange(k) // group
    weight_t = (q - zeros.float()[groups]) * scales.float()[groups]
    expected = x.float() @ weight_t
    got = w4a16_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float().cpu(), expected, **tolerance)
    assert got.dtype == dtype


@pytest.mark.parametrize("m", [1, 33])
def test_act_order_reads_each_inputs_group_from_g_idx(m):
    k, n, group = 96, 40, 32
    x, qweight, scales, zeros = _case(m, k, n, group, torch.float32, seed=m)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=torch.Generator().manual_seed(5))].to(torch.int32)
    weight_t = (unpack_int4(qweight, 0).float() - zeros.float()[g_idx.long()]) * scales.float()[g_idx.long()]
    got = w4a16_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group, g_idx.to(DEVICE))
    torch.testing.assert_close(got.cpu(), x @ weight_t, atol=1e-4, rtol=1e-4)
    in_order = w4a16_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group)
    assert not torch.allclose(in_order.cpu(), got.cpu())  # the order matters: g_idx is really read


def test_bad_layouts_are_named():
    x, qweight, scales, zeros = _case(2, 64, 16, 32, torch.float32, 0)
    with pytest.raises(ValueError, match="does not pack K = 64"):
        w4a16_matmul(x, qweight[:4], scales, zeros, 32)
    with pytest.raises(ValueError, match="do not cover K = 64 in groups of 16"):
        w4a16_matmul(x, qweight, scales, zeros, 16)
