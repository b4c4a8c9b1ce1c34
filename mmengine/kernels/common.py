"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

LOG2E = 1.4426950408889634
# The attention kernels take a sliding window as a plain int; no window is one wider than any context
# (and small enough that position - window stays within int32).
NO_WINDOW = 1 << 30


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def has_fp8_type(device: torch.device) -> bool:
    """Whether Triton's e4m3 type compiles here: compute capability 8.9+, or the interpreter on CPU."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs would otherwise be multiplied in TF32 on GPUs: keep them exact. For 16-bit
    inputs the target's default applies (the setting only concerns fp32 operands)."""
    return "ieee" if dtype == torch.float32 else None


def kernel_window(window: int | None) -> int:
    """A sliding window as the attention kernels take it: keys k > q - window are visible."""
    if window is None:
        return NO_WINDOW
    if not 1 <= window <= NO_WINDOW:
        raise ValueError(f"a sliding window must be in [1, {NO_WINDOW}], got {window}")
    return window


def kernel_chunk(chunk: int | None) -> int:
    """An attention chunk as the attention kernels take it: keys k >= q // chunk * chunk are visible (no chunk is
    one longer than any context, whose start is 0 for every query)."""
    if chunk is None:
        return NO_WINDOW
    if not 1 <= chunk <= NO_WINDOW:
        raise ValueError(f"an attention chunk must be in [1, {NO_WINDOW}], got {chunk}")
    return chunk


def padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def launch_options(num_warps: int = 4, num_stages: int = 3) -> dict[str, object]:
    """Compile options every launch states: warps and software-pipeline stages (the tuning knobs;
    `python -m mmengine.kernels.cross_compile` reports their registers, spills and shared memory)
    and FMA contraction, on, as Triton's default is about to change."""
    return {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}


# Shared memory one block may take on sm_90 (H100, H200: 227 KiB): the limit assumed where none can be read
# (the interpreter ignores it; the cross-compiler records launches on CPU tensors for sm_80 and sm_90).
SM90_SHARED_MEMORY = 232448
# A GEMM's K tile holds this many bytes of activations per row: fp32 takes half the inputs of a 16-bit type,
# so that its pipelined tiles fit where theirs do.
K_TILE_BYTES = 128


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory a block may take on `device` (the opt-in maximum: 227 KiB on Hopper and
    A100-class parts, about 99 KiB on consumer ones)."""
    if device.type != "cuda":
        return SM90_SHARED_MEMORY
    return _cuda_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class GemmTiles:
    """A GEMM loop's launch configuration and the shared memory it takes at most."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    shared_bytes: int


def pipelined_shared_memory(block_m: int, block_n: int, block_k: int, num_stages: int, act_bytes: int,
                            weight_bytes: int, weight_tiles: int = 1) -> int:
    """An upper bound of the shared memory of a loop over K that multiplies an activation tile [block_m,
    block_k] by `weight_tiles` weight tiles [block_k, block_n]: the dot's operands in the activations' dtype,
    plus, per stage past the first, a buffer for everything one step loads. Triton's pipeliner buffers
    every load of the loop, not only the dot's operands: a dequantizing GEMM's packed words, scales and zero
    points (`weight_bytes` per weight element, all together) take most of it."""
    activations = block_m * block_k * act_bytes
    weights = weight_tiles * block_k * block_n
    return activations + weights * act_bytes + (num_stages - 1) * (activations + weights * weight_bytes)


def fit_gemm_tiles(block_m: int, block_n: int, block_k: int, most_stages: int, act_bytes: int, weight_bytes: int,
                   limit: int, weight_tiles: int = 1) -> GemmTiles:
    """These tiles with the most stages, up to `most_stages`, that fit in `limit` bytes (one stage at least:
    no pipelining)."""
    stages = most_stages
    while stages > 1 and pipelined_shared_memory(block_m, block_n, block_k, stages, act_bytes, weight_bytes, weight_tiles) > limit:
        stages -= 1
    shared = pipelined_shared_memory(block_m, block_n, block_k, stages, act_bytes, weight_bytes, weight_tiles)
    return GemmTiles(block_m, block_n, block_k, stages, shared)
