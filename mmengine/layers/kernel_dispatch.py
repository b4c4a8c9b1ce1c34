"""Which implementation the decoder's small ops (rotary + K/V store, RMSNorm, SiLU-and-mul) take:
the fused Triton kernels on CUDA, the PyTorch references elsewhere, except that the Triton
attention backend on a CPU (possible only under TRITON_INTERPRET=1) runs the kernels too, so the
interpreter exercises the same path a GPU takes."""

from __future__ import annotations

import torch

from mmengine.layers.attention import triton_unavailable_reason


def use_fused_kernels(device: torch.device, attn_backend_name: str | None) -> bool:
    if triton_unavailable_reason(device) is not None:
        return False
    return device.type == "cuda" or attn_backend_name == "triton"
