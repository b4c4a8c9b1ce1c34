"""A tensor-parallel rank's routed experts kept quantized, as TP 1 keeps them (models/vlm.py's use_quantized_experts:
SiLU experts stored one tensor per expert, FP8 or int4 without act-order, one group size).

Each rank keeps its part of every expert's bits and scales (`ParallelFusedExperts`: gate and up rows, down columns
of its intermediate share) or its experts whole (`ExpertParallelFusedExperts`), stacked as TP 1 stacks them into
Fp8FusedExperts / Int4FusedExperts, and `QuantizedParallelExperts` all-reduces their output as the dense layers do.
gate_up (inputs: the hidden size, never split) and down (inputs: the rank's intermediate share) share one group size
in the fused kernel, so where the rank's down keeps finer scales (quantized_rank_layout.py) gate_up's are repeated to
the same grain: the same values.
"""

from __future__ import annotations

import torch
from torch import nn

from mmengine.distributed.parallel_experts import ExpertParallelFusedExperts, ParallelFusedExperts
from mmengine.distributed.quantized_rank_layout import RankSlice, rank_layout
from mmengine.distributed.quantized_slices import QuantizedWeightSlice
from mmengine.layers.moe import Fp8FusedExperts, Int4FusedExperts, QuantizedFusedExperts
from mmengine.models.quantization import PackedFp8, PackedInt4, dequantize_packed

ParallelExperts = (ParallelFusedExperts, ExpertParallelFusedExperts)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ExpertLayouts = dict[tuple[int, str], PackedFp8 | PackedInt4]  # (the rank's expert, projection) -> its layout


class QuantizedParallelExperts(nn.Module):
    """The rank's quantized experts (`quantized`) and the all-reduce of their partial outputs; with expert
    parallelism, a pair routed to another rank's expert adds zero here (fused_moe's skip_past_end)."""

    def __init__(self, quantized: QuantizedFusedExperts, dense: ParallelFusedExperts | ExpertParallelFusedExperts) -> None:
        super().__init__()
        self.quantized, self.tp, self.name = quantized, dense.tp, dense.name
        self.num_experts, self.top_k, self.intermediate_size = dense.num_experts, dense.top_k, dense.intermediate_size
        self.held = getattr(dense, "held", None)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
        if self.held is None:
            return self.tp.all_reduce(self.quantized(x, weights, experts))
        from mmengine.kernels.fused_moe import fused_moe

        q = self.quantized
        local = experts - self.held.start
        mine = (local >= 0) & (local < self.num_experts)
        local = torch.where(mine, local, self.num_experts)
        weights = torch.where(mine, weights, torch.zeros_like(weights))
        out = fused_moe(x, q.gate_up_proj, q.down_proj, weights, local, q.gate_up_scales, q.down_scales, q.group,
                        q.gate_up_zeros, q.down_zeros, skip_past_end=True)
        return self.tp.all_reduce(out)


def expert_rank_layout(module: nn.Module, expert: int, projection: str, weight: QuantizedWeightSlice) -> PackedFp8 | PackedInt4 | None:
    """The rank's part of one expert's projection (an expert this rank holds) in the kernels' layout, or None."""
    out, inp = weight.shape
    tp = module.tp
    label = f"{module.name}.{expert}.{projection}"
    if isinstance(module, ExpertParallelFusedExperts):  # whole experts
        return rank_layout(weight, RankSlice(0, out, 0, inp, label, tp.size))
    size, start = module.intermediate_size, tp.rank * module.intermediate_size
    if projection == "down_proj":
        return rank_layout(weight, RankSlice(0, out, start, start + size, label, tp.size))
    return rank_layout(weight, RankSlice(start, start + size, 0, inp, label, tp.size))


def local_expert(module: nn.Module, expert: int) -> int:
    return expert - module.held.start if isinstance(module, ExpertParallelFusedExperts) else expert


def quantized_experts(module: ParallelFusedExperts | ExpertParallelFusedExperts, parts: ExpertLayouts,
                      device: torch.device) -> QuantizedParallelExperts | None:
    """The rank's experts kept quantized when every held expert came in one format (int4: no act-order), else None."""
    wanted = [(e, p) for e in range(module.num_experts) for p in PROJECTIONS]
    if not module.act.fusable or any(key not in parts for key in wanted):
        return None
    layouts = [parts[key] for key in wanted]
    if all(isinstance(p, PackedFp8) for p in layouts):
        grain = min(p.group_k for p in layouts)
        if any(p.group_k % grain for p in layouts):
            return None
        at = {key: _fp8_at(parts[key], grain) for key in wanted}

        def stacked(field: str, projs: tuple[str, ...]) -> torch.Tensor:
            return torch.stack([torch.cat([getattr(at[e, p], field) for p in projs]) for e in range(module.num_experts)]).to(device)

        quantized: QuantizedFusedExperts = Fp8FusedExperts(module, stacked("weight", PROJECTIONS[:2]), stacked("scales", PROJECTIONS[:2]),
                                                           stacked("weight", PROJECTIONS[2:]), stacked("scales", PROJECTIONS[2:]), grain)
    elif all(isinstance(p, PackedInt4) and p.g_idx is None for p in layouts):
        grain = min(p.group_size for p in layouts)
        if any(p.group_size % grain for p in layouts):
            return None
        at4 = {key: _int4_at(parts[key], grain) for key in wanted}

        def stacked4(field: str, projs: tuple[str, ...]) -> torch.Tensor:
            return torch.stack([torch.cat([getattr(at4[e, p], field) for p in projs], dim=1) for e in range(module.num_experts)]).to(device)

        gate_up, down = PROJECTIONS[:2], PROJECTIONS[2:]
        quantized = Int4FusedExperts(module, stacked4("qweight", gate_up), stacked4("scales", gate_up), stacked4("zeros", gate_up),
                                     stacked4("qweight", down), stacked4("scales", down), stacked4("zeros", down), grain)
    else:
        return None
    return QuantizedParallelExperts(quantized, module)


def _fp8_at(layout: PackedFp8, grain: int) -> PackedFp8:
    """The same weight with its scales per `grain` inputs (a divisor of its group)."""
    if layout.group_k == grain:
        return layout
    columns = torch.arange(-(-layout.weight.shape[1] // grain)) * grain // layout.group_k
    return PackedFp8(layout.weight, layout.scales[:, columns].contiguous(), grain, layout.activations_dynamic)


def _int4_at(layout: PackedInt4, grain: int) -> PackedInt4:
    if layout.group_size == grain:
        return layout
    rows = torch.arange(-(-layout.qweight.shape[0] * 8 // grain)) * grain // layout.group_size
    return PackedInt4(layout.qweight, layout.scales[rows].contiguous(), layout.zeros[rows].contiguous(), grain)


def load_dequantized(module: nn.Module, parts: ExpertLayouts) -> None:
    """Experts that cannot stay quantized: each kept layout dequantized into the rank's dense experts."""
    with torch.no_grad():
        for (e, projection), layout in parts.items():
            dense = dequantize_packed(layout)
            if projection == "down_proj":
                module.down_proj[e].copy_(dense)
            else:
                size = module.gate_up_proj.shape[1] // 2
                module.gate_up_proj[e].narrow(0, 0 if projection == "gate_proj" else size, size).copy_(dense)
