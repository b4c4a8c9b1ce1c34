"""Llama 4's decoder split over the tensor-parallel ranks.

```
q/k/v, o            by heads (k/v by the KV-head rule); on RoPE layers each head's q and k rows are put in the
                    rotary's layout after this rank's rows are read (the permutation stays inside a head)
experts             on their intermediate size, from transformers' transposed layout ([E, H, 2I], [E, I, H]), or
                    whole experts per rank with expert parallelism (this rank's experts of that layout)
shared expert, MLP  gate/up column-, down row-parallel; the router whole
embed_tokens        vocabulary-parallel
```
"""

from __future__ import annotations

import torch
from torch import nn

from mmengine.distributed.parallel_experts import ExpertParallelFusedExperts, ParallelFusedExperts
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.distributed.sharded_gemma import shard_gemma_attention
from mmengine.distributed.sharding import Loaded, copy_into, loaded_shape, read_rows
from mmengine.errors import WeightsMismatchError
from mmengine.models.llama4_text import interleaved_to_halves


class TransposedParallelExperts(ParallelFusedExperts):
    """Experts saved as transformers keeps Llama 4's: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        full, size = self.full_intermediate_size, self.intermediate_size
        start = self.tp.rank * size
        shape = loaded_shape(loaded)
        hidden = self.gate_up_proj.shape[2]
        if param is self.gate_up_proj:
            if shape != (self.num_experts, hidden, 2 * full):
                raise WeightsMismatchError(f"{self.name}.gate_up_proj: expected [{self.num_experts}, {hidden}, {2 * full}], got {list(shape)}")
            copy_into(param.narrow(1, 0, size), read_rows(loaded, 2, start, size).transpose(1, 2), f"{self.name}.gate_up_proj[gate]")
            copy_into(param.narrow(1, size, size), read_rows(loaded, 2, full + start, size).transpose(1, 2), f"{self.name}.gate_up_proj[up]")
            return
        if shape != (self.num_experts, full, hidden):
            raise WeightsMismatchError(f"{self.name}.down_proj: expected [{self.num_experts}, {full}, {hidden}], got {list(shape)}")
        copy_into(param, read_rows(loaded, 1, start, size).transpose(1, 2), f"{self.name}.down_proj")


class TransposedExpertParallelExperts(ExpertParallelFusedExperts):
    """This rank's whole experts from transformers' transposed layout: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""

    def fused_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        (experts, double, hidden), (_, _, inter) = super().fused_shapes()
        return (experts, hidden, double), (experts, inter, hidden)

    def read_experts(self, loaded: Loaded) -> torch.Tensor:
        return super().read_experts(loaded).transpose(1, 2)


def rotary_rows(layer: nn.Module, head_dim: int) -> None:
    """After each of `layer`'s parameters loads, its rows are put in the rotary's layout, head by head."""
    for param in layer.parameters(recurse=False):
        load = param.weight_loader

        def loader(target: nn.Parameter, loaded: Loaded, *args: object, load=load) -> None:
            load(target, loaded, *args)
            with torch.no_grad():
                target.copy_(interleaved_to_halves(target.data.clone(), head_dim))

        param.weight_loader = loader


def shard_llama4_decoder(decoder: nn.Module, tp: TensorParallelGroup, split_mlp, expert_parallel: bool = False) -> None:
    experts_class = TransposedExpertParallelExperts if expert_parallel else TransposedParallelExperts
    hidden = decoder.config.hidden_size
    for index, layer in enumerate(decoder.layers):
        prefix = f"language_model.layers.{index}"
        attn = layer.self_attn
        head_dim = attn.head_dim
        shard_gemma_attention(attn, hidden, tp, f"{prefix}.self_attn")
        if attn.use_rope:
            rotary_rows(attn.q_proj, head_dim)
            rotary_rows(attn.k_proj, head_dim)
        ff = layer.feed_forward
        if getattr(layer, "is_moe", False):
            ff.experts = experts_class(ff.experts, tp, f"{prefix}.feed_forward.experts")
            split_mlp(ff.shared_expert, hidden, tp, f"{prefix}.feed_forward.shared_expert")
        else:
            split_mlp(ff, hidden, tp, f"{prefix}.feed_forward")
