"""CUDA graphs on a tensor-parallel rank: decode and verify steps whose all-reduces and all-gathers are captured
with them.

A rank's step runs collectives (row-parallel all-reduces, the vocabulary all-gather), so a graph of it holds NCCL
kernels that pair with the same graph's on every other rank. What that takes, as vLLM's `graph_capture` context
(`parallel_state.py`) and SGLang's graph runner do it:

- the communicator exists before any capture: NCCL creates it at the group's first collective, which a capture
  cannot record, so the capturer runs an all-reduce and an all-gather first (`warm_up_collectives`);
- every graph is captured on one side stream of the rank's own, after the work queued before it; torch's NCCL
  process group runs a captured collective on its stream, joined to the capture stream by events (torch records
  no watchdog work during a capture, and waits for the work queued before it to finish);
- each step is run once eagerly before its capture (kernels compiled, the collectives of that shape exercised
  on every rank), and every rank captures the same graphs in the same order (`DecodeGraphs.capture_order`, from
  the config: the driver compares the ranks' orders before any capture);
- a rank whose capture fails raises CudaGraphCaptureError; the driver then stops every rank (one that waits in a
  warm-up collective for the failed one is killed, not left waiting) and start-up fails with that error.

vLLM and SGLang replace torch's all-reduce under capture with their own (pynccl, a custom all-reduce over IPC
buffers) for speed; this module keeps torch.distributed's, which torch supports inside a capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.errors import CudaGraphCaptureError
from mmengine.runner.cuda_graphs import CudaGraphCapturer, GraphCapturer, Replay

logger = logging.getLogger(__name__)


def capture_failed(tp: TensorParallelGroup, err: BaseException) -> CudaGraphCaptureError:
    """The error a rank raises when its capture fails, naming the rank and the cause and the way out."""
    if isinstance(err, CudaGraphCaptureError):
        return err
    return CudaGraphCaptureError(f"tensor_parallel_size={tp.size}: capturing CUDA graphs failed on rank {tp.rank} "
                                 f"({type(err).__name__}: {err}); pass enforce_eager=True to run without CUDA graphs")


class TensorParallelCapturer:
    """Real CUDA graphs on one rank, its collectives inside them (module docstring). All share one memory pool
    and one capture stream."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp = tp
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=tp.device)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        try:
            self.warm_up_collectives()
        except Exception as err:
            raise capture_failed(tp, err) from err

    def warm_up_collectives(self) -> None:
        """Creates the communicator (and its buffers) outside any capture, on every rank at once."""
        probe = torch.ones(1, 8, device=self.tp.device)
        self.tp.all_reduce(probe)
        self.tp.all_gather_last_dim(probe)
        torch.cuda.synchronize(self.tp.device)
        self.tp.barrier()

    def capture(self, fn: Callable[[], None]) -> Replay:
        try:
            fn()  # compiles and autotunes outside the capture; its collectives run eagerly on every rank
            torch.cuda.synchronize(self.tp.device)
            graph = torch.cuda.CUDAGraph()
            self.stream.wait_stream(torch.cuda.current_stream(self.tp.device))
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                fn()
        except Exception as err:
            raise capture_failed(self.tp, err) from err
        self.graphs.append(graph)
        return graph.replay

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.tp.device)
        self.tp.barrier()


def rank_capturer(tp: TensorParallelGroup) -> Callable[[], GraphCapturer]:
    """The runner's capturer_factory on a rank: graphs that capture its collectives (a single rank: plain ones)."""
    if tp.size == 1:
        return CudaGraphCapturer
    return lambda: TensorParallelCapturer(tp)
