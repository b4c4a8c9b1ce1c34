"""Qwen3.5's hybrid decoder split over the tensor-parallel ranks (vLLM's layout): the Gated DeltaNet layers by
their heads, the gated attention layers by theirs.

```
GatedDeltaNet   in_proj_qkv [q | k | v] and the conv's channels: each of q, k (key heads) and v (value heads) split,
                so rank r holds key heads [r K/tp, (r+1) K/tp) and the value heads they serve (V/K consecutive each);
                in_proj_z, in_proj_b, in_proj_a, dt_bias, A_log: the value heads split; the gated norm (one value
                head's width) whole; out_proj row-parallel. Each rank's recurrent states hold its heads only.
GatedAttention  q_proj ([query | gate] per head) split by heads; k/v by KV heads (split, or replicated when the ranks
                outnumber them); q/k norms whole; o_proj row-parallel.
```
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mmengine.distributed.parallel_linear import ColumnParallelLinear, MergedColumnParallelLinear, Piece, RowParallelLinear
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.distributed.sharding import Loaded, copy_into, divide, kv_head_split, loaded_shape, read_rows, read_shard
from mmengine.errors import WeightsMismatchError
from mmengine.layers.gated_delta import GatedDeltaNet, GatedDeltaShape


def rank_shape(shape: GatedDeltaShape, tp_size: int) -> GatedDeltaShape:
    """One rank's Gated DeltaNet shape: its key and value heads."""
    return dataclasses.replace(shape, num_key_heads=divide(shape.num_key_heads, tp_size, "the text model", "linear_num_key_heads"),
                               num_value_heads=divide(shape.num_value_heads, tp_size, "the text model", "linear_num_value_heads"))


class SplitVector(nn.Module):
    """Holds nothing: gives a per-head vector parameter (dt_bias, A_log) a loader of this rank's heads."""

    def __init__(self, full: int, tp: TensorParallelGroup, name: str) -> None:
        super().__init__()
        self.full, self.size, self.tp, self.name = full, full // tp.size, tp, name

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        copy_into(param, read_shard(loaded, 0, self.tp.rank * self.size, self.size, self.full, self.name), self.name)


class SplitConv:
    """The depthwise conv's weight [conv_dim, 1, kernel]: this rank's channels of each of q, k and v."""

    def __init__(self, fulls: list[int], tp: TensorParallelGroup, name: str) -> None:
        sizes = [full // tp.size for full in fulls]
        self.pieces = [Piece(full, tp.rank * size, size, sum(sizes[:i])) for i, (full, size) in enumerate(zip(fulls, sizes))]
        self.name = name

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        total = sum(piece.full for piece in self.pieces)
        if loaded_shape(loaded)[0] != total:
            raise WeightsMismatchError(f"{self.name}: expected {total} channels, got a tensor of shape {list(loaded_shape(loaded))}")
        at = 0
        for piece in self.pieces:
            copy_into(param.narrow(0, piece.offset, piece.size), read_rows(loaded, 0, at + piece.start, piece.size), self.name)
            at += piece.full


def shard_gated_delta_net(layer: GatedDeltaNet, tp: TensorParallelGroup, prefix: str) -> None:
    full = layer.shape
    s = rank_shape(full, tp.size)
    hidden = full.hidden_size
    layer.in_proj_qkv = MergedColumnParallelLinear(hidden, [full.key_dim, full.key_dim, full.value_dim], bias=False, tp=tp,
                                                   name=f"{prefix}.in_proj_qkv")
    layer.in_proj_z = ColumnParallelLinear(hidden, full.value_dim, bias=False, tp=tp, name=f"{prefix}.in_proj_z")
    layer.in_proj_b = ColumnParallelLinear(hidden, full.num_value_heads, bias=False, tp=tp, name=f"{prefix}.in_proj_b")
    layer.in_proj_a = ColumnParallelLinear(hidden, full.num_value_heads, bias=False, tp=tp, name=f"{prefix}.in_proj_a")
    layer.out_proj = RowParallelLinear(full.value_dim, hidden, bias=False, tp=tp, name=f"{prefix}.out_proj")
    conv = nn.Conv1d(s.conv_dim, s.conv_dim, kernel_size=s.conv_kernel, groups=s.conv_dim, bias=False)
    conv.weight.requires_grad_(False)
    conv.weight.weight_loader = SplitConv([full.key_dim, full.key_dim, full.value_dim], tp, f"{prefix}.conv1d").weight_loader
    layer.conv1d = conv
    for name in ("dt_bias", "A_log"):
        param = nn.Parameter(torch.empty(s.num_value_heads), requires_grad=False)
        param.weight_loader = SplitVector(full.num_value_heads, tp, f"{prefix}.{name}").weight_loader
        setattr(layer, name, param)
    layer.shape = s


def shard_gated_attention(attn: nn.Module, tp: TensorParallelGroup, prefix: str) -> None:
    hidden = attn.q_proj.in_features
    d = attn.head_dim
    split = kv_head_split(attn.num_kv_heads, tp.size, f"{prefix}.k_proj")
    heads = divide(attn.num_heads, tp.size, f"{prefix}.q_proj", "num_attention_heads")
    bias = attn.q_proj.bias is not None
    attn.q_proj = ColumnParallelLinear(hidden, 2 * attn.num_heads * d, bias=bias, tp=tp, name=f"{prefix}.q_proj")
    kv_rows = split.heads_per_rank * d
    for name in ("k_proj", "v_proj"):
        piece = Piece(attn.num_kv_heads * d, split.first_head(tp.rank) * d, kv_rows, 0)
        setattr(attn, name, MergedColumnParallelLinear(hidden, [piece.full], bias=bias, tp=tp, name=f"{prefix}.{name}", pieces=[piece]))
    attn.o_proj = RowParallelLinear(attn.num_heads * d, attn.o_proj.out_features, bias=attn.o_proj.bias is not None, tp=tp,
                                    name=f"{prefix}.o_proj")
    attn.num_heads, attn.num_kv_heads = heads, split.heads_per_rank
    attn.attn.num_heads, attn.attn.num_kv_heads = heads, split.heads_per_rank
