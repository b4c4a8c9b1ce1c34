"""torch.distributed for one rank: where the ranks meet, the tensor-parallel group, and its collectives.

A rank calls `init_distributed(DistributedInit(...))` once and gets its `TensorParallelGroup`; the parallel
layers take that group (or `single_rank_group()` at TP 1, where no collective runs and torch.distributed is not
needed). Gloo on CPU, NCCL on CUDA (each rank on the GPU of its rank). Today the TP group is the whole world
(no pipeline or data parallelism inside one replica).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mmengine.errors import ConfigError


@dataclass(frozen=True)
class DistributedInit:
    """What one rank needs to join the others (plain data: it crosses to the spawned worker)."""

    world_size: int
    rank: int
    init_method: str  # "tcp://127.0.0.1:PORT" (free_tcp_address) or "file:///path" (file_address)
    device: str = "cpu"  # "cpu" or "cuda" (the rank's GPU: cuda:local_rank)
    backend: str | None = None  # None: "nccl" on CUDA, "gloo" on CPU
    local_rank: int | None = None  # the rank on its machine (None: rank; a machine per rank group needs it, Ray)
    timeout_s: float = 1800.0  # a collective that waits longer fails (a dead peer is noticed sooner, by the executor)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if not self.init_method.startswith(("tcp://", "file://")):
            raise ConfigError(f"init_method must be 'tcp://HOST:PORT' or 'file:///PATH', got {self.init_method!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")

    def torch_device(self) -> torch.device:
        local_rank = self.rank if self.local_rank is None else self.local_rank
        return torch.device("cuda", local_rank) if self.device == "cuda" else torch.device("cpu")


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """A rendezvous on a TCP port free now on `host` (rank 0 binds it shortly after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def file_address(path: str | os.PathLike[str]) -> str:
    """A rendezvous in a file that does not exist yet (no port to race for; the file is left behind)."""
    return f"file://{Path(path).resolve()}"


class TensorParallelGroup:
    """This rank's place in the tensor-parallel group and the collectives the parallel layers use."""

    def __init__(self, rank: int, size: int, device: torch.device, group: Any = None) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.group = group  # a torch ProcessGroup; None with size 1 or for the default (world) group

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, size={self.size}, device={self.device})"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place (returned for chaining)."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` side by side along the last dimension, rank 0 first."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` as rank `src` holds it, on every rank (pickled; for plain data, not for tensors)."""
        if self.size == 1:
            return obj
        holder = [obj if self.rank == src else None]
        dist.broadcast_object_list(holder, src=src, group=self.group)
        return holder[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


def single_rank_group(device: str | torch.device = "cpu") -> TensorParallelGroup:
    """TP 1: the parallel layers are plain layers, and nothing touches torch.distributed."""
    return TensorParallelGroup(0, 1, torch.device(device))


def init_distributed(init: DistributedInit) -> TensorParallelGroup:
    """Joins the other ranks (blocks until all have joined) and returns this rank's TP group."""
    device = init.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if init.world_size == 1:
        return TensorParallelGroup(0, 1, device)
    dist.init_process_group(
        backend=init.resolved_backend,
        init_method=init.init_method,
        world_size=init.world_size,
        rank=init.rank,
        timeout=datetime.timedelta(seconds=init.timeout_s),
    )
    return TensorParallelGroup(init.rank, init.world_size, device)


def destroy_distributed() -> None:
    """Leaves the group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
