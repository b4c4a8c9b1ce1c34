"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import os

import torch
import triton

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs would otherwise be multiplied in TF32 on GPUs: keep them exact. For 16-bit
    inputs the target's default applies (the setting only concerns fp32 operands)."""
    return "ieee" if dtype == torch.float32 else None


def padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))
