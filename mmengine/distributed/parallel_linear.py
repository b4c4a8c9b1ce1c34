"""Linear layers split over the tensor-parallel ranks (Megatron's pattern, as vLLM loads checkpoints into it).

```
ColumnParallelLinear        W [out, in]: each rank holds out/tp rows; y is split on its last dim (or gathered)
MergedColumnParallelLinear  gate/up in one matmul: each piece split on its own, so rank r holds gate_r ++ up_r
QKVParallelLinear           q/k/v in one matmul: q heads split; KV heads split, or replicated when tp > KV heads
RowParallelLinear           W [out, in]: each rank holds in/tp columns of a split input; all-reduce; bias once
```

Each parameter carries `weight_loader(param, loaded[, shard_id])`, also reachable as `param.weight_loader`:
`loaded` is the checkpoint tensor whole, already cut to this rank's shard, or a safetensors slice
(`safe_open(...).get_slice(name)`), of which only this rank's rows are read from disk. The merged layers
take the piece a checkpoint tensor is (`shard_id`: 0/1 or "q"/"k"/"v"), or None for a checkpoint that stores
the pieces fused. A size that does not divide is a ConfigError naming the layer, the dimension and the TP size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmengine.distributed.process_group import TensorParallelGroup, single_rank_group
from mmengine.distributed.sharding import Loaded, copy_into, divide, kv_head_split, loaded_shape, read_rows, read_shard
from mmengine.errors import WeightsMismatchError


def _parameter(*shape: int, dtype: torch.dtype | None, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split: rank r computes y[..., r*out/tp:(r+1)*out/tp]."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, gather_output: bool = False,
                 tp: TensorParallelGroup | None = None, name: str = "", dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, output_size_per_rank: int | None = None) -> None:
        super().__init__()
        self.tp = tp or single_rank_group()
        self.name = name or type(self).__name__
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.output_size_per_rank = (divide(output_size, self.tp.size, self.name, "output_size")
                                     if output_size_per_rank is None else output_size_per_rank)
        self.weight = _parameter(self.output_size_per_rank, input_size, dtype=dtype, device=device)
        self.bias = _parameter(self.output_size_per_rank, dtype=dtype, device=device) if bias else None
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size_per_rank}/{self.output_size}, tp={self.tp.rank}/{self.tp.size}"

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        size = self.output_size_per_rank
        copy_into(param, read_shard(loaded, 0, self.tp.rank * size, size, self.output_size, self.name), self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return self.tp.all_gather_last_dim(y) if self.gather_output else y


@dataclass(frozen=True)
class Piece:
    """One of a merged layer's pieces: its rows in the checkpoint (`full`), this rank's share of them
    (`start`, `size`), and where that share sits in this rank's parameter (`offset`)."""

    full: int
    start: int
    size: int
    offset: int


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers over the same input in one matmul (gate and up): each piece is split
    on its own, so each rank's output is its share of every piece, pieces in order. `pieces` (this rank's
    layout) is given by subclasses whose pieces are not split evenly (QKVParallelLinear)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], *, bias: bool = True,
                 tp: TensorParallelGroup | None = None, name: str = "", dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, pieces: Sequence[Piece] | None = None,
                 shard_ids: Sequence[object] | None = None) -> None:
        tp = tp or single_rank_group()
        name = name or type(self).__name__
        if pieces is None:
            sizes = [divide(full, tp.size, name, f"output_sizes[{i}]") for i, full in enumerate(output_sizes)]
            pieces = make_pieces(list(output_sizes), sizes, [tp.rank * size for size in sizes])
        super().__init__(input_size, sum(output_sizes), bias=bias, gather_output=False, tp=tp, name=name, dtype=dtype,
                         device=device, output_size_per_rank=sum(piece.size for piece in pieces))
        self.pieces = list(pieces)
        self.output_sizes = list(output_sizes)
        ids = list(range(len(self.pieces))) if shard_ids is None else list(shard_ids)
        self.shard_ids: dict[object, int] = {shard_id: i for i, shard_id in enumerate(ids)}
        self.shard_ids.update({i: i for i in range(len(self.pieces))})

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:  # type: ignore[override]
        if shard_id is None:
            self.load_fused(param, loaded)
            return
        if shard_id not in self.shard_ids:
            raise WeightsMismatchError(f"{self.name}: no piece {shard_id!r} (pieces: {', '.join(map(repr, self.shard_ids))})")
        piece = self.pieces[self.shard_ids[shard_id]]
        label = f"{self.name}[{shard_id!r}]"
        copy_into(param.narrow(0, piece.offset, piece.size), read_shard(loaded, 0, piece.start, piece.size, piece.full, label), label)

    def load_fused(self, param: nn.Parameter, loaded: Loaded) -> None:
        """A checkpoint tensor holding every piece one after another: whole, or already this rank's shard."""
        rows = loaded_shape(loaded)[0]
        whole = sum(piece.full for piece in self.pieces)
        if rows == whole:
            at = 0
            for piece in self.pieces:
                copy_into(param.narrow(0, piece.offset, piece.size), read_rows(loaded, 0, at + piece.start, piece.size), self.name)
                at += piece.full
        elif rows == param.shape[0]:
            copy_into(param, read_rows(loaded, 0, 0, rows), self.name)
        else:
            raise WeightsMismatchError(f"{self.name}: a fused tensor of {rows} rows is neither the whole ({whole}) nor this rank's shard ({param.shape[0]})")


def make_pieces(fulls: list[int], sizes: list[int], starts: list[int]) -> list[Piece]:
    """Pieces laid one after another in this rank's parameter."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [Piece(full, start, size, offset) for full, start, size, offset in zip(fulls, starts, sizes, offsets)]


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul (pieces "q", "k", "v", or 0, 1, 2). Query heads are split (they
    must divide); KV heads are split when tp_size divides them, replicated when tp_size is a multiple of them
    (rank r then holds KV head r // (tp_size / num_kv_heads)), and refused by name otherwise."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int | None = None, *,
                 bias: bool = True, tp: TensorParallelGroup | None = None, name: str = "",
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        tp = tp or single_rank_group()
        name = name or type(self).__name__
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        heads_per_rank = divide(num_heads, tp.size, name, "num_attention_heads")
        kv_split = kv_head_split(num_kv_heads, tp.size, name)
        q_size, kv_size = heads_per_rank * head_size, kv_split.heads_per_rank * head_size
        kv_start = kv_split.first_head(tp.rank) * head_size
        fulls = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        pieces = make_pieces(fulls, [q_size, kv_size, kv_size], [tp.rank * q_size, kv_start, kv_start])
        super().__init__(hidden_size, fulls, bias=bias, tp=tp, name=name, dtype=dtype, device=device, pieces=pieces,
                         shard_ids=("q", "k", "v"))
        self.head_size = head_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_per_rank = heads_per_rank
        self.num_kv_heads_per_rank = kv_split.heads_per_rank
        self.kv_replicas = kv_split.replicas
        self.q_size = q_size
        self.kv_size = kv_size

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's q, k and v from the layer's output."""
        return tuple(qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split: rank r multiplies its share of x (the output of a column-
    parallel layer) by its columns; the partial sums are all-reduced and the bias added once, after."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, input_is_parallel: bool = True,
                 reduce_results: bool = True, tp: TensorParallelGroup | None = None, name: str = "",
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp = tp or single_rank_group()
        self.name = name or type(self).__name__
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_rank = divide(input_size, self.tp.size, self.name, "input_size")
        self.weight = _parameter(output_size, self.input_size_per_rank, dtype=dtype, device=device)
        self.bias = _parameter(output_size, dtype=dtype, device=device) if bias else None
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        return f"in={self.input_size_per_rank}/{self.input_size}, out={self.output_size}, tp={self.tp.rank}/{self.tp.size}"

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        if param is self.bias:  # not split: every rank holds it, one adds it
            copy_into(param, read_shard(loaded, 0, 0, self.output_size, self.output_size, self.name), self.name)
            return
        size = self.input_size_per_rank
        copy_into(param, read_shard(loaded, 1, self.tp.rank * size, size, self.input_size, self.name), self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp.rank * self.input_size_per_rank, self.input_size_per_rank)
        if not self.reduce_results:  # the caller reduces: the bias goes with rank 0's partial sum alone
            return F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
