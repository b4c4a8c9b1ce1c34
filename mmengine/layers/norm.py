"""RMSNorm, alone or fused with the residual add that precedes it (vLLM's `norm(x, residual)`).

The reference functions here are transformers' Llama RMSNorm to the letter (normalise in float32,
round to the model dtype, multiply by the weight in the model dtype; the residual add in the model
dtype): the CPU path, and the oracle for the Triton kernels, which round at the same places.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x)."""
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def add_norm(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, use_kernel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(stream), stream), the stream being residual + x, or x itself where there is no residual yet
    (the embeddings, before the first layer): a pre-norm decoder's step into a layer's sublayer."""
    if residual is None:
        return norm(x, use_kernel=use_kernel), x
    return norm(x, residual, use_kernel=use_kernel)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, use_kernel: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x)."""
        if use_kernel:
            from mmengine.kernels.rms_norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm_reference(x, self.weight, self.eps)
        return fused_add_rms_norm_reference(x, residual, self.weight, self.eps)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: the weight is stored as an offset from one (initialised to zeros) and the
    product is taken in float32 before rounding, `(norm(x) * (1 + w)).to(dtype)`, unlike Llama's
    `w * norm(x).to(dtype)`. Always the PyTorch path: the fused kernel rounds at Llama's place."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, use_kernel: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x)."""
        if residual is not None:
            residual = residual + x
            x = residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class ScaledRMSNorm(nn.Module):
    """Gemma 4's RMSNorm: normalised (by pow(mean(x^2) + eps, -1/2), as transformers writes it) and
    multiplied by the weight as it is, both in float32, then rounded; `with_weight=False` (Gemma 4's
    v_norm and router norm) only normalises."""

    def __init__(self, hidden_size: int, eps: float, with_weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if with_weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.to(x.dtype)
