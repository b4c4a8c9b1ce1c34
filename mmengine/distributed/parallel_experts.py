"""A mixture-of-experts layer's experts split over the tensor-parallel ranks on their intermediate size (vLLM's
default for MoE under TP): every rank holds every expert, each its share of every expert's intermediate rows.

```
gate_up_proj [E, 2 I, H]   rank r: gate rows [r I/tp, (r+1) I/tp) ++ up rows [I + r I/tp, I + (r+1) I/tp)
down_proj    [E, H, I]     rank r: columns [r I/tp, (r+1) I/tp)
output                     each rank's partial sum over its intermediate share, all-reduced
```

The router is replicated, so every rank routes every token alike. Checkpoints that store the experts fused
(transformers 5's layout) are read slice by slice: a rank reads only its rows of each expert.
"""

from __future__ import annotations

import torch
from torch import nn

from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.distributed.sharding import Loaded, copy_into, divide, loaded_shape, read_rows
from mmengine.errors import WeightsMismatchError
from mmengine.layers.moe import FusedExperts


class ParallelFusedExperts(FusedExperts):
    def __init__(self, dense: FusedExperts, tp: TensorParallelGroup, name: str) -> None:
        per_rank = divide(dense.intermediate_size, tp.size, name, "moe_intermediate_size")
        super().__init__(dense.num_experts, dense.gate_up_proj.shape[2], per_rank, dense.act.hidden_act, dense.top_k)
        self.tp = tp
        self.name = name
        self.full_intermediate_size = dense.intermediate_size
        for param in (self.gate_up_proj, self.down_proj):
            param.requires_grad_(False)
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        full, size = self.full_intermediate_size, self.intermediate_size
        start = self.tp.rank * size
        shape = loaded_shape(loaded)
        if param is self.gate_up_proj:
            if shape != (self.num_experts, 2 * full, param.shape[2]):
                raise WeightsMismatchError(f"{self.name}.gate_up_proj: expected [{self.num_experts}, {2 * full}, {param.shape[2]}], got {list(shape)}")
            copy_into(param.narrow(1, 0, size), read_rows(loaded, 1, start, size), f"{self.name}.gate_up_proj[gate]")
            copy_into(param.narrow(1, size, size), read_rows(loaded, 1, full + start, size), f"{self.name}.gate_up_proj[up]")
            return
        if shape != (self.num_experts, param.shape[1], full):
            raise WeightsMismatchError(f"{self.name}.down_proj: expected [{self.num_experts}, {param.shape[1]}, {full}], got {list(shape)}")
        copy_into(param, read_rows(loaded, 2, start, size), f"{self.name}.down_proj")

    def load_expert(self, expert: int, projection: str, loaded: Loaded) -> None:
        """One expert's gate_proj/up_proj [I, H] or down_proj [H, I] (checkpoints that store each expert apart)."""
        full, size = self.full_intermediate_size, self.intermediate_size
        start = self.tp.rank * size
        label = f"{self.name}.{expert}.{projection}"
        if not 0 <= expert < self.num_experts:
            raise WeightsMismatchError(f"{label}: the layer has {self.num_experts} experts")
        if projection == "down_proj":
            if loaded_shape(loaded) != (self.down_proj.shape[1], full):
                raise WeightsMismatchError(f"{label}: expected [{self.down_proj.shape[1]}, {full}], got {list(loaded_shape(loaded))}")
            copy_into(self.down_proj[expert], read_rows(loaded, 1, start, size), label)
            return
        if loaded_shape(loaded) != (full, self.gate_up_proj.shape[2]):
            raise WeightsMismatchError(f"{label}: expected [{full}, {self.gate_up_proj.shape[2]}], got {list(loaded_shape(loaded))}")
        offset = 0 if projection == "gate_proj" else size
        copy_into(self.gate_up_proj[expert].narrow(0, offset, size), read_rows(loaded, 0, start, size), label)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x, weights, experts, use_kernel))
