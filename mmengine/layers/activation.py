"""The MLP's gated activation over the fused gate/up projection: act(gate) * up.

SiLU (Llama, Mistral, Qwen2) has a fused Triton kernel; other activations take the PyTorch path.
The reference rounds where transformers does: silu(gate) in the model dtype, then the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def activation_module(hidden_act: str) -> nn.Module:
    """transformers' activation by its config name (ACT2FN). Imported when a model is built, not with the module:
    transformers.activations pulls its model-loading code and torch.distributed.tensor (over a second), which the
    processes that import a family's module only to prepare inputs (front ends, preprocessing workers) never use."""
    from transformers.activations import ACT2FN

    return ACT2FN[hidden_act]


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] (gate, then up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class GatedActivation(nn.Module):
    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        self.hidden_act = hidden_act
        self.act = activation_module(hidden_act)

    @property
    def fusable(self) -> bool:
        """Whether the fused activation kernel computes it (SiLU)."""
        return self.hidden_act == "silu"

    @property
    def fused_moe_ready(self) -> bool:
        """Whether the fused MoE kernel computes it (SiLU, or GELU's tanh approximation)."""
        return self.hidden_act in ("silu", "gelu_pytorch_tanh", "gelu_new")

    def forward(self, gate_up: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
        if use_kernel and self.fusable:
            from mmengine.kernels.activation import silu_and_mul

            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
