"""StepThreads: on a CPU device, the intra-op threads a model step takes while preprocessing workers are busy.

The step's towers and decoder run on the engine's torch threads, and the preprocessing workers
(multimodal/preprocess_pool.py) on cores of their own. Both at full width oversubscribe the machine: an
intra-op thread sharing its core with a worker runs at half speed, and the step waits for it at every
parallel region while the other threads spin. So while workers prepare pictures, a step takes the
process's threads less one per busy worker (at least one), and once the pool is idle it takes them all:
a batch's late steps, after its last picture is prepared, use every core.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch


class BusyWorkers(Protocol):
    num_in_flight: int  # pictures a worker is preparing now


class StepThreads:
    def __init__(self, pool: BusyWorkers) -> None:
        self.pool = pool
        self.num_narrowed = 0  # steps that ran on fewer threads than the process's

    @contextmanager
    def around_step(self) -> Iterator[int]:
        """Runs a step on the threads the busy workers leave (yields that count); the process's own setting
        (torch.set_num_threads, read now) is back afterwards."""
        threads = torch.get_num_threads()
        width = max(1, threads - self.pool.num_in_flight)
        if width == threads:
            yield threads
            return
        torch.set_num_threads(width)
        self.num_narrowed += 1
        try:
            yield width
        finally:
            torch.set_num_threads(threads)
