"""Mixture-of-experts MLPs (Qwen3-VL-MoE, Qwen3.5-MoE): a softmax top-k router over fused expert weights,
and, in Qwen3.5-MoE, a shared expert gated by sigmoid(shared_expert_gate(x)).

The router is transformers' to the letter (logits in the model dtype, softmax in fp32, top-k, the
chosen weights renormalised to sum to one, cast back), so ties break alike and greedy tokens match.
Expert weights are stored as transformers 5 saves them, `experts.gate_up_proj` [experts, 2 x inter,
hidden] and `experts.down_proj` [experts, hidden, inter]; checkpoints with one tensor per expert are
stacked at load (models/loader.py's `fuse_expert_tensors`). The PyTorch path computes each expert
that received tokens on its tokens, in expert order, as transformers does; with the fused kernels on
(CUDA, or Triton's interpreter) kernels/fused_moe.py runs them all in two grouped GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from mmengine.layers.activation import GatedActivation


class TopKRouter(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (routing weights [T, k] in x's dtype, expert ids [T, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str, top_k: int = 1) -> None:
        """`top_k`: experts per token (what reads the weights needs to know, e.g. a read floor)."""
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = GatedActivation(hidden_act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for every token t: kernels/fused_moe.py's two
        grouped GEMMs when `use_kernel` (SiLU or GELU-tanh experts), else each expert that got tokens in turn."""
        if use_kernel and self.act.fused_moe_ready:
            from mmengine.kernels.fused_moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, weights, experts, activation=self.act.hidden_act)
        return self.expert_loop(x, weights, torch.nn.functional.one_hot(experts, self.num_experts))

    def expert_loop(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The PyTorch path: `chosen` [T, k, E] one-hot (a row of zeros: a pair no expert here computes)."""
        out = torch.zeros_like(x)
        tokens_of = chosen.permute(2, 1, 0)  # [E, k, T]
        for expert in (tokens_of.sum(dim=(1, 2)) > 0).nonzero()[:, 0].tolist():
            slot, token = torch.where(tokens_of[expert])
            h = F.linear(self.act(F.linear(x[token], self.gate_up_proj[expert])), self.down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out


class QuantizedFusedExperts(nn.Module):
    """Experts whose weights stay quantized where the fused kernels run (kernels/fused_moe.py dequantizes
    them in registers): buffers gate_up_proj, down_proj and their scales (and zeros: int4)."""

    def __init__(self, dense: FusedExperts, group: int, **tensors: torch.Tensor | None) -> None:
        super().__init__()
        if not dense.act.fusable:
            raise ValueError(f"{type(self).__name__} run the fused MoE kernel, which computes SiLU experts only")
        self.num_experts, self.top_k, self.intermediate_size = dense.num_experts, dense.top_k, dense.intermediate_size
        self.group = group
        for name, tensor in tensors.items():
            self.register_buffer(name, None if tensor is None else tensor.contiguous())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
        from mmengine.kernels.fused_moe import fused_moe

        return fused_moe(x, self.gate_up_proj, self.down_proj, weights, experts, self.gate_up_scales, self.down_scales, self.group,
                         self.gate_up_zeros, self.down_zeros)


class Fp8FusedExperts(QuantizedFusedExperts):
    """gate_up_proj / down_proj in e4m3 as FusedExperts lays them out, with fp32 scales [experts, rows,
    ceil(inputs / group)] (kernels/fp8_gemm.py's layout per expert)."""

    def __init__(self, dense: FusedExperts, gate_up: torch.Tensor, gate_up_scales: torch.Tensor, down: torch.Tensor,
                 down_scales: torch.Tensor, group_k: int) -> None:
        super().__init__(dense, group_k, gate_up_proj=gate_up, gate_up_scales=gate_up_scales, down_proj=down,
                         down_scales=down_scales, gate_up_zeros=None, down_zeros=None)


class Int4FusedExperts(QuantizedFusedExperts):
    """kernels/w4a16.py's packing per expert: gate_up_proj int32 [experts, hidden / 8, 2 x inter] (gate then
    up along the outputs), down_proj [experts, inter / 8, hidden], scales and zeros [experts, groups, outputs]."""

    def __init__(self, dense: FusedExperts, gate_up: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_zeros: torch.Tensor,
                 down: torch.Tensor, down_scales: torch.Tensor, down_zeros: torch.Tensor, group_size: int) -> None:
        super().__init__(dense, group_size, gate_up_proj=gate_up, gate_up_scales=gate_up_scales, gate_up_zeros=gate_up_zeros,
                         down_proj=down, down_scales=down_scales, down_zeros=down_zeros)


class SparseMoeBlock(nn.Module):
    """The router and the experts, plus Qwen3.5-MoE's gated shared expert when `shared_mlp` is given."""

    def __init__(self, config: PretrainedConfig, shared_mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = TopKRouter(config.num_experts, config.num_experts_per_tok, config.hidden_size)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, config.hidden_act,
                                    config.num_experts_per_tok)
        self.shared_expert = shared_mlp
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared_mlp is not None else None

    def forward(self, x: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts, use_kernels)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, use_kernels)
        return out


def is_sparse_layer(config: PretrainedConfig, index: int) -> bool:
    """Whether decoder layer `index` has experts (Qwen3-VL-MoE: every decoder_sparse_step-th layer not in
    mlp_only_layers; Qwen3.5-MoE: every layer)."""
    if getattr(config, "num_experts", 0) <= 0:
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return index not in (getattr(config, "mlp_only_layers", None) or ()) and (index + 1) % step == 0
