"""Whether the Triton kernels can run here, and which implementation the decoder's small ops (rotary +
K/V store, RMSNorm, SiLU-and-mul) take: the fused Triton kernels on CUDA, the PyTorch references
elsewhere, except that the Triton attention backend on a CPU (possible only under TRITON_INTERPRET=1)
runs the kernels too, so the interpreter exercises the same path a GPU takes."""

from __future__ import annotations

import os

import torch


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on this device, or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton kernels need a CUDA device, or TRITON_INTERPRET=1 to run them (slowly) on {device.type}"


def use_fused_kernels(device: torch.device, attn_backend_name: str | None) -> bool:
    if triton_unavailable_reason(device) is not None:
        return False
    return device.type == "cuda" or attn_backend_name == "triton"
