"""What the ranks of tests/test_distributed_executor.py and the Ray actors of test_ray_tensor_parallel.py run, in a
module of its own: a spawned rank imports the module its worker class comes from, and this one needs torch and the
executor alone (not pytest, psutil, the test module)."""

from __future__ import annotations

import os
import sys
import time

import torch

from mmengine.distributed.executor import MultiprocExecutor
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.errors import ConfigError

TP = 2


class RankWorker:
    """What each rank holds in these tests: its group, and a few steps that use a collective."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp = tp
        self.steps = 0

    def execute_step(self, plan: dict) -> dict:
        self.steps += 1
        total = self.tp.all_reduce(torch.tensor([float(self.tp.rank + 1)]))  # every rank took part
        return {"echo": plan["id"], "plan_bytes": len(plan["payload"]), "rank_sum": total.item(), "steps": self.steps}

    def pid(self) -> int:
        return os.getpid()

    def imported(self, names: list[str]) -> list[str]:
        """Those of `names` this rank's interpreter has imported."""
        return [name for name in names if name in sys.modules]

    def fail_on(self, rank: int) -> None:
        if self.tp.rank == rank:
            raise KeyError(f"no such block on rank {rank}")

    def sleep_then_reduce(self, sleeping_rank: int, seconds: float) -> float:
        if self.tp.rank == sleeping_rank:
            time.sleep(seconds)
        return self.tp.all_reduce(torch.ones(1)).item()

    def peer_gone(self, dying_rank: int, delay_s: float) -> None:
        """The order a real death can take: the survivor's collective fails first, the peer's exit follows."""
        if self.tp.rank == dying_rank:
            time.sleep(delay_s)
            os._exit(3)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29500")


def refuse_to_start(tp: TensorParallelGroup) -> None:
    raise ConfigError(f"layers.0.qkv: num_key_value_heads=3 cannot be split over tensor_parallel_size={tp.size}")


def start(on_death=None, **options) -> MultiprocExecutor:
    return MultiprocExecutor(RankWorker, TP, torch_threads=1, on_death=on_death, **options)
