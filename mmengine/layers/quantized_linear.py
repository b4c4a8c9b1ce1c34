"""Linear layers whose weights stay quantized on the device: Int4Linear through the W4A16 GEMM
(kernels/w4a16.py), Fp8Linear through the FP8 GEMM (kernels/fp8_gemm.py), both dequantizing in registers;
Fp8Linear through the W8A8 GEMM (kernels/w8a8.py) instead where fp8_dispatch.py allows.

Built after loading from the quantized checkpoint's own values (models/quantization.py keeps them,
normalised to one layout per format), the shards of a fused projection (q/k/v, gate/up) concatenated
along the outputs; one replaces the dense layer the load filled, whose weight is then freed.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from mmengine.kernels.fp8_gemm import fp8_matmul
from mmengine.kernels.w4a16 import w4a16_matmul
from mmengine.kernels.w8a8 import w8a8_matmul
from mmengine.layers.fp8_dispatch import compute_capability, why_not_w8a8
from mmengine.models.quantization import PackedFp8, PackedInt4


class QuantizedLinear(nn.Module, abc.ABC):
    """A projection whose weight stays quantized; subclasses give the GEMM over their layout."""

    in_features: int
    out_features: int

    def __init__(self, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @abc.abstractmethod
    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, in_features], contiguous -> [T, out_features]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, self.in_features).contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int4Linear(QuantizedLinear):
    """qweight int32 [in / 8, out], scales and zeros [groups, out], g_idx [in] (act-order) or None."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, g_idx: torch.Tensor | None = None) -> None:
        super().__init__(bias)
        self.in_features, self.out_features = qweight.shape[0] * 8, qweight.shape[1]
        self.group_size = group_size
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("zeros", zeros.contiguous())
        self.register_buffer("g_idx", None if g_idx is None else g_idx.contiguous())

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return w4a16_matmul(rows, self.qweight, self.scales, self.zeros, self.group_size, self.g_idx)


class Fp8Linear(QuantizedLinear):
    """weight e4m3 [out, in], scales fp32 [out, ceil(in / group_k)]; with `w8a8`, every call quantizes
    its activations per token and runs the W8A8 GEMM (scales [out, 1])."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, group_k: int, bias: torch.Tensor | None,
                 w8a8: bool = False) -> None:
        super().__init__(bias)
        self.out_features, self.in_features = weight.shape
        self.group_k = group_k
        self.w8a8 = w8a8
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scales", scales.contiguous())

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.w8a8:
            return w8a8_matmul(rows, self.weight, self.scales)
        return fp8_matmul(rows, self.weight, self.scales, self.group_k)


def fuse_shards(parts: list[PackedInt4] | list[PackedFp8], bias: torch.Tensor | None, device: torch.device,
                dtype: torch.dtype) -> QuantizedLinear | None:
    """One layer for a fused projection's shards (concatenated along the outputs), or None where they
    cannot share one (different group sizes or formats). `dtype` is the activations' (the model's): with
    the device it decides whether an FP8 layer may take W8A8."""
    if all(isinstance(p, PackedInt4) for p in parts) and len({p.group_size for p in parts}) == 1 and _same_g_idx(parts):
        g_idx = parts[0].g_idx
        return Int4Linear(torch.cat([p.qweight for p in parts], dim=1).to(device), torch.cat([p.scales for p in parts], dim=1).to(device),
                          torch.cat([p.zeros for p in parts], dim=1).to(device), parts[0].group_size, bias,
                          None if g_idx is None else g_idx.to(device))
    if all(isinstance(p, PackedFp8) for p in parts) and len({p.group_k for p in parts}) == 1:
        weight = torch.cat([p.weight for p in parts]).to(device)
        w8a8 = why_not_w8a8(compute_capability(device), dtype, weight.shape[1], weight.shape[0], parts[0].group_k,
                            all(p.activations_dynamic for p in parts)) is None
        return Fp8Linear(weight, torch.cat([p.scales for p in parts]).to(device), parts[0].group_k, bias, w8a8)
    return None


def _same_g_idx(parts: list[PackedInt4]) -> bool:
    """Shards fuse only when their inputs share one group order (act-order GPTQ orders them by the
    input's statistics, the same for q, k and v)."""
    first = parts[0].g_idx
    return all((p.g_idx is None) == (first is None) and (first is None or torch.equal(p.g_idx, first)) for p in parts)
