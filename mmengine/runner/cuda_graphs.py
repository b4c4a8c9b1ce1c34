"""CUDA graphs for decode-only and verify steps: batch-size buckets, capture and replay.

A decode step launches the same kernels every time; only the values in the input buffers change.
So each bucket size is captured once at start-up over the persistent input buffers and replayed
as one launch. A batch is padded up to the next bucket with rows that store nothing. Prefill and
mixed steps stay eager. With cascade attention on, sizes from 2 up also get a cascade variant:
the same step with the shared-prefix pass, over the cascade buffers (runner/cascade_plan.py). With
LoRA enabled, every size also gets a LoRA variant: each row adds the delta of the adapter slot the
per-row buffer names (-1: none), so the base variant of a step without adapters pays nothing for LoRA.
With speculative decoding, each size up to the token budget also gets a verify graph
(runner/verify_graphs.py): room for num_speculative_tokens + 1 tokens a request, the real tokens
packed as in an eager step, the rest padding rows that store nothing.

The capture itself goes through a `GraphCapturer`: on CUDA it records a real graph; on CPU the
`EagerCapturer` stand-in "replays" by calling the same function over the same static buffers,
which exercises the bookkeeping (buckets, padding, static buffers) without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

Replay = Callable[[], None]


def graph_batch_sizes(max_num_seqs: int, max_size: int | None = None) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, capped at (and including) the cap."""
    cap = min(max_num_seqs, max_size or max_num_seqs)
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, cap + 1, 16)]
    sizes = sorted({s for s in sizes if s <= cap} | {cap})
    return sizes


def padded_batch_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds num_reqs, or None when the batch is larger than every bucket."""
    index = bisect.bisect_left(sizes, num_reqs)
    return sizes[index] if index < len(sizes) else None


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], None]) -> Replay: ...

    def synchronize(self) -> None: ...


class CudaGraphCapturer:
    """Records real CUDA graphs; all of them share one memory pool (captured largest first, the
    smaller ones reuse its memory)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn: Callable[[], None]) -> Replay:
        fn()  # compiles and autotunes outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        self.graphs.append(graph)
        return graph.replay

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class EagerCapturer:
    """The CPU stand-in: a replay calls the captured function again over the same buffers."""

    def capture(self, fn: Callable[[], None]) -> Replay:
        fn()
        return fn

    def synchronize(self) -> None:
        pass


@dataclass
class CaptureReport:
    sizes: list[int]
    seconds: float
    memory_bytes: int  # device memory the graphs hold (0 for the CPU stand-in)


@dataclass(frozen=True)
class ReplayCounts:
    """A rank's graph replays so far (plain data: rank 0's travel back to the driver with each step)."""

    num_replays: int = 0
    num_cascade_replays: int = 0
    num_lora_replays: int = 0
    num_verify_replays: int = 0


class DecodeGraphs:
    """One replayable decode step per bucket size, and a cascade-attention variant of the sizes in
    `cascade_sizes` (its groups are read from buffers like every other input). With `verify_sizes`,
    a verify step of up to `verify_query_len` tokens a request for each of those sizes."""

    def __init__(self, sizes: list[int], cascade_sizes: list[int] | None = None, lora_sizes: list[int] | None = None,
                 verify_sizes: list[int] | None = None, verify_query_len: int = 1) -> None:
        self.sizes = sorted(sizes)
        self.cascade_sizes = sorted(cascade_sizes or [])
        self.lora_sizes = sorted(lora_sizes or [])
        self.verify_sizes = sorted(verify_sizes or [])
        self.verify_query_len = verify_query_len
        self._replays: dict[tuple[int, bool, bool], Replay] = {}
        self._verify_replays: dict[int, Replay] = {}
        self.num_replays = 0
        self.num_cascade_replays = 0
        self.num_lora_replays = 0
        self.num_verify_replays = 0

    def variants(self, size: int) -> list[tuple[bool, bool]]:
        """(cascade, lora) of each graph captured for `size`."""
        return [(False, False)] + [(True, False)] * (size in self.cascade_sizes) + [(False, True)] * (size in self.lora_sizes)

    def capture_all(self, step_for: Callable[[int, bool, bool], Callable[[], None]], capturer: GraphCapturer,
                    device: torch.device, verify_step_for: Callable[[int], Callable[[], None]] | None = None) -> CaptureReport:
        """Captures verify_step_for(size) for every verify bucket, then step_for(size, cascade, lora) for
        every bucket and variant, largest first."""
        on_cuda = device.type == "cuda"
        if on_cuda:
            # A capture empties the allocator's cache first: without this, memory cached before it
            # (the profile run's) would be released during the capture and count against the graphs.
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        for kind, size, cascade, lora in self.capture_order():
            if kind == "verify":
                self._verify_replays[size] = capturer.capture(verify_step_for(size))
            else:
                self._replays[(size, cascade, lora)] = capturer.capture(step_for(size, cascade, lora))
        capturer.synchronize()
        seconds = time.perf_counter() - start
        memory = torch.cuda.memory_reserved(device) - before if on_cuda else 0
        return CaptureReport(list(self.sizes), seconds, memory)

    def capture_order(self) -> list[tuple[str, int, bool, bool]]:
        """(kind, size, cascade, lora) of every graph, in the order capture_all records them: the verify graphs,
        the most tokens first (the others reuse their memory), then each decode bucket's variants, largest first.
        Tensor-parallel ranks must agree on it: each graph's collectives pair with the same graph's on the others."""
        order = [("verify", size, False, False) for size in reversed(self.verify_sizes)]
        return order + [("decode", size, cascade, lora) for size in reversed(self.sizes) for cascade, lora in self.variants(size)]

    def counts(self) -> ReplayCounts:
        return ReplayCounts(self.num_replays, self.num_cascade_replays, self.num_lora_replays, self.num_verify_replays)

    def bucket_for(self, num_reqs: int) -> int | None:
        return padded_batch_size(num_reqs, self.sizes)

    def verify_bucket_for(self, num_reqs: int) -> int | None:
        return padded_batch_size(num_reqs, self.verify_sizes)

    def replay(self, size: int, cascade: bool = False, lora: bool = False) -> None:
        self._replays[(size, cascade, lora)]()
        self.num_replays += 1
        self.num_cascade_replays += cascade
        self.num_lora_replays += lora

    def replay_verify(self, size: int) -> None:
        self._verify_replays[size]()
        self.num_verify_replays += 1
