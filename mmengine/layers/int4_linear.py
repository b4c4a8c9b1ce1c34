"""A linear layer whose weight stays in 4 bits on the device: the W4A16 GEMM (kernels/w4a16.py) reads
it packed and dequantizes in registers.

Built after loading from the quantized checkpoint's own integers (models/quantization.py keeps them,
normalised to one layout: `qweight` [in / 8, out], `scales` and `zeros` [groups, out], `g_idx` [in]),
the shards of a fused projection (q/k/v, gate/up) concatenated along the outputs; it replaces the
dense layer the load filled, whose weight is then freed.
"""

from __future__ import annotations

import torch
from torch import nn

from mmengine.kernels.w4a16 import w4a16_matmul


class Int4Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[0] * 8, qweight.shape[1]
        self.group_size = group_size
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("zeros", zeros.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = w4a16_matmul(rows.contiguous(), self.qweight, self.scales, self.zeros, self.group_size)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)
