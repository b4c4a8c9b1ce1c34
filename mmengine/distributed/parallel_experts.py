"""A mixture-of-experts layer's experts split over the tensor-parallel ranks, one of two ways.

On their intermediate size (`ParallelFusedExperts`, vLLM's default for MoE under TP): every rank holds every
expert, each its share of every expert's intermediate rows.

```
gate_up_proj [E, 2 I, H]   rank r: gate rows [r I/tp, (r+1) I/tp) ++ up rows [I + r I/tp, I + (r+1) I/tp)
down_proj    [E, H, I]     rank r: columns [r I/tp, (r+1) I/tp)
output                     each rank's partial sum over its intermediate share, all-reduced
```

Whole experts per rank (`ExpertParallelFusedExperts`, `enable_expert_parallel=True`): rank r holds experts
[r E/tp, (r+1) E/tp), every one whole.

```
gate_up_proj [E/tp, 2 I, H], down_proj [E/tp, H, I]   this rank's experts
output     every token through this rank's experts it chose (a pair routed elsewhere adds zero), all-reduced
```

The attention before is tensor-parallel, so every rank holds every token's hidden state after its all-reduce:
each rank computes its experts' share of every token and one all-reduce sums the shares, the collective the
intermediate split makes too. An all-to-all dispatch (each rank sending a token's row to the ranks of its experts
and back, then gathering every token) costs three collectives where this costs one; benchmarks/expert_parallel.py
measures both (docs/parallelism.md).

The router is replicated, so every rank routes every token alike. Checkpoints that store the experts fused
(transformers 5's layout) are read slice by slice: a rank reads only its rows (or its experts) of each tensor;
of experts stored one by one, a rank reads only its own (of the others nothing).
"""

from __future__ import annotations

import torch
from torch import nn

from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.distributed.sharding import Loaded, copy_into, divide, loaded_shape, read_rows
from mmengine.errors import ConfigError, WeightsMismatchError
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


def expert_range(num_experts: int, tp_size: int, rank: int, layer: str = "the text model") -> range:
    """The experts rank `rank` holds with expert parallelism: [rank E/tp, (rank+1) E/tp)."""
    if num_experts % tp_size:
        raise ConfigError(f"{layer}: enable_expert_parallel needs num_experts={num_experts} divisible by "
                          f"tensor_parallel_size={tp_size} (each rank holds as many whole experts)")
    per_rank = num_experts // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


class ExpertParallelFusedExperts(FusedExperts):
    """This rank's whole experts (`expert_range`); `num_experts` is their count, `num_checkpoint_experts` the layer's."""

    def __init__(self, dense: FusedExperts, tp: TensorParallelGroup, name: str) -> None:
        held = expert_range(dense.num_experts, tp.size, tp.rank, name)
        super().__init__(len(held), dense.gate_up_proj.shape[2], dense.intermediate_size, dense.act.hidden_act, dense.top_k)
        self.tp = tp
        self.name = name
        self.held = held
        self.num_checkpoint_experts = dense.num_experts
        for param in (self.gate_up_proj, self.down_proj):
            param.requires_grad_(False)
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def holds(self, expert: int) -> bool:
        return expert in self.held

    def fused_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The checkpoint's gate_up_proj and down_proj shapes (all the layer's experts)."""
        experts, inter, hidden = self.num_checkpoint_experts, self.intermediate_size, self.gate_up_proj.shape[2]
        return (experts, 2 * inter, hidden), (experts, hidden, inter)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        gate_up, down = self.fused_shapes()
        which, expected = ("gate_up_proj", gate_up) if param is self.gate_up_proj else ("down_proj", down)
        if loaded_shape(loaded) != expected:
            raise WeightsMismatchError(f"{self.name}.{which}: expected {list(expected)}, got {list(loaded_shape(loaded))}")
        copy_into(param, self.read_experts(loaded), f"{self.name}.{which}")

    def read_experts(self, loaded: Loaded) -> torch.Tensor:
        """This rank's experts of a fused tensor, in the layout the parameter keeps."""
        return read_rows(loaded, 0, self.held.start, len(self.held))

    def load_expert(self, expert: int, projection: str, loaded: Loaded) -> None:
        """One expert's gate_proj/up_proj [I, H] or down_proj [H, I] (checkpoints that store each expert apart):
        read when this rank holds the expert, left unread otherwise."""
        label = f"{self.name}.{expert}.{projection}"
        if not 0 <= expert < self.num_checkpoint_experts:
            raise WeightsMismatchError(f"{label}: the layer has {self.num_checkpoint_experts} experts")
        hidden, inter = self.gate_up_proj.shape[2], self.intermediate_size
        expected = (hidden, inter) if projection == "down_proj" else (inter, hidden)
        if loaded_shape(loaded) != expected:
            raise WeightsMismatchError(f"{label}: expected {list(expected)}, got {list(loaded_shape(loaded))}")
        if not self.holds(expert):
            return
        local = expert - self.held.start
        whole = read_rows(loaded, 0, 0, expected[0])
        if projection == "down_proj":
            copy_into(self.down_proj[local], whole, label)
        else:
            copy_into(self.gate_up_proj[local].narrow(0, 0 if projection == "gate_proj" else inter, inter), whole, label)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
        """Every token's pairs routed to this rank's experts (the others weigh zero and are not computed), then the
        ranks' sums all-reduced."""
        local = experts - self.held.start
        mine = (local >= 0) & (local < self.num_experts)
        local = torch.where(mine, local, self.num_experts)  # one past the last: computed by another rank
        weights = torch.where(mine, weights, torch.zeros_like(weights))
        if use_kernel and self.act.fused_moe_ready:
            from mmengine.kernels.fused_moe import fused_moe

            out = fused_moe(x, self.gate_up_proj, self.down_proj, weights, local, activation=self.act.hidden_act, skip_past_end=True)
        else:
            out = self.expert_loop(x, weights, torch.nn.functional.one_hot(local, self.num_experts + 1)[..., : self.num_experts])
        return self.tp.all_reduce(out)
