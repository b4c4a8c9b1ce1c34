"""Rotary position embedding (GPT-NeoX layout: the two halves of the head dim rotate together)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mmengine.errors import UnsupportedModelError

# Types whose frequencies depend on the current sequence length are not position-pure,
# so a cached KV entry would no longer match a recomputed one.
_UNSUPPORTED_ROPE_TYPES = {"dynamic", "longrope"}


def rope_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling for the config's rope type, as transformers computes them."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type in _UNSUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"unknown rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [num_tokens, 1, head_dim] for broadcasting over heads."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype)[:, None, :], (emb.sin() * self.scaling).to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, num_heads, head_dim]."""
        return x * cos + rotate_half(x) * sin
