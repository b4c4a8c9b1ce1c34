"""Picks the attention backend: the Triton kernels on CUDA, the PyTorch reference elsewhere."""

from __future__ import annotations

import torch

from mmengine.errors import ConfigError
from mmengine.layers.attention import AttentionBackend
from mmengine.layers.kernel_dispatch import triton_unavailable_reason
from mmengine.layers.torch_attention import TorchAttentionBackend


def get_attention_backend(requested: str, device: torch.device) -> AttentionBackend:
    """'auto' picks the Triton kernels on CUDA, else the PyTorch reference; 'triton' forces the kernels."""
    reason = triton_unavailable_reason(device)
    name = requested
    if requested == "auto":
        name = "triton" if device.type == "cuda" and reason is None else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if reason is not None:
        raise ConfigError(f"attn_backend='triton' is not available: {reason}")
    from mmengine.layers.triton_attention import TritonAttentionBackend  # imports triton: only when asked for

    return TritonAttentionBackend()
