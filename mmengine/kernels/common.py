"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import os

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


def padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def launch_options(num_warps: int = 4, num_stages: int = 3) -> dict[str, object]:
    """Compile options every launch states: warps and software-pipeline stages (the tuning knobs;
    `python -m mmengine.kernels.cross_compile` reports their registers, spills and shared memory)
    and FMA contraction, on, as Triton's default is about to change."""
    return {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
