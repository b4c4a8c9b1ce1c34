"""How a tensor is split over the tensor-parallel ranks: sizes that must divide, the KV-head rule, and
reading one rank's slice of a checkpoint tensor (a safetensors slice reads only those rows from disk).

A shape that does not divide is a ConfigError naming the layer, the dimension and the TP size, raised when
the layer is built (start-up), never a wrong answer later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from mmengine.errors import ConfigError, WeightsMismatchError


@runtime_checkable
class TensorSlice(Protocol):
    """What `safe_open(...).get_slice(name)` returns: the shape from the header, rows read on indexing."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


Loaded = torch.Tensor | TensorSlice  # what a weight loader accepts: a whole tensor, or a lazy slice of one


def divide(size: int, tp_size: int, layer: str, dim: str) -> int:
    """`size / tp_size`, or a ConfigError naming what does not divide."""
    if size % tp_size:
        raise ConfigError(f"{layer or 'a layer'}: {dim}={size} is not divisible by tensor_parallel_size={tp_size}")
    return size // tp_size


@dataclass(frozen=True)
class KVHeadSplit:
    """Where this rank's KV heads come from. With more ranks than KV heads each head is replicated on
    `replicas` consecutive ranks (vLLM's rule); otherwise `replicas` is 1 and each rank has its own heads."""

    heads_per_rank: int
    replicas: int

    def first_head(self, rank: int) -> int:
        return (rank // self.replicas) * self.heads_per_rank


def kv_head_split(num_kv_heads: int, tp_size: int, layer: str = "") -> KVHeadSplit:
    """KV heads split when tp_size divides them, replicated when tp_size is a multiple of them, else refused."""
    if num_kv_heads % tp_size == 0:
        return KVHeadSplit(num_kv_heads // tp_size, 1)
    if tp_size > num_kv_heads and tp_size % num_kv_heads == 0:
        return KVHeadSplit(1, tp_size // num_kv_heads)
    raise ConfigError(
        f"{layer or 'a layer'}: num_key_value_heads={num_kv_heads} can be neither split over nor replicated on "
        f"tensor_parallel_size={tp_size} (one must divide the other)"
    )


def routed_experts(text_config: Any) -> int:
    """The experts of a MoE layer of the decoder (0: a dense decoder; Llama 4 calls them num_local_experts, and
    Gemma 4's are there with its MoE block only)."""
    if getattr(text_config, "enable_moe_block", True) is False:
        return 0
    return getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None) or 0


def loaded_shape(loaded: Loaded) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def read_rows(loaded: Loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """`loaded[start:start + size]` along `dim` (0 or 1); from a safetensors slice only those bytes are read."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = (slice(start, start + size),) if dim == 0 else (slice(None),) * dim + (slice(start, start + size),)
    return loaded[index]


def read_shard(loaded: Loaded, dim: int, start: int, size: int, full: int, layer: str) -> torch.Tensor:
    """This rank's `size` rows along `dim` from `loaded`: either the whole checkpoint tensor (`full` rows, of
    which rows `start:start + size` are taken) or a tensor already cut to this rank's `size` rows."""
    shape = loaded_shape(loaded)
    if dim >= len(shape):
        raise WeightsMismatchError(f"{layer}: a tensor of shape {list(shape)} has no dimension {dim} to shard")
    if shape[dim] == full:
        return read_rows(loaded, dim, start, size)
    if shape[dim] == size:
        return read_rows(loaded, dim, 0, size)
    raise WeightsMismatchError(
        f"{layer}: dimension {dim} of the loaded tensor is {shape[dim]}, neither the whole ({full}) nor this rank's shard ({size})"
    )


def copy_into(param: torch.Tensor, shard: torch.Tensor, layer: str) -> None:
    """Copies a read shard into (a part of) a parameter, refusing a shape that differs."""
    if tuple(param.shape) != tuple(shard.shape):
        raise WeightsMismatchError(f"{layer}: expected a shard of shape {list(param.shape)}, got {list(shard.shape)}")
    with torch.no_grad():
        param.copy_(shard)
