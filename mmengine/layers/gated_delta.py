"""Gated DeltaNet: Qwen3.5's linear-attention layer (three of every four decoder layers), over a packed
step of several requests, each continuing its own live state.

A request's state is a slot in `GatedDeltaStates`: the causal conv's window (the last kernel-1 inputs
of the q/k/v projection) and the recurrent state [value heads, key dim, value dim] in fp32. A step's
new tokens for a request, whatever their number (a prefill chunk, a decode token), continue that
state exactly, so chunked prefill and decode give the tokens of one full pass.

This is the PyTorch path (the CPU, and the reference the CUDA kernels are tested against): the delta
rule runs token by token per request, as transformers' `torch_recurrent_gated_delta_rule` does. The
parameters are named as transformers names them, so a checkpoint's tensors load one to one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GatedDeltaShape:
    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def of(cls, text_config: object) -> GatedDeltaShape:
        """The shape a transformers Qwen3.5 text config gives its linear-attention layers."""
        c = text_config
        return cls(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                   c.linear_value_head_dim, c.linear_conv_kernel_dim, c.rms_norm_eps)


class GatedDeltaStates:
    """The live states of one linear-attention layer, one slot per running request."""

    def __init__(self, shape: GatedDeltaShape, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.conv = torch.zeros(num_slots, shape.conv_dim, shape.conv_kernel - 1, device=device, dtype=dtype)
        self.recurrent = torch.zeros(num_slots, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim,
                                     device=device, dtype=torch.float32)

    def reset(self, slot: int) -> None:
        """A new request in `slot` starts from nothing."""
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, then gated by silu(z) (in fp32, as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(dtype)) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, shape: GatedDeltaShape) -> None:
        super().__init__()
        self.shape = s = shape
        self.in_proj_qkv = nn.Linear(s.hidden_size, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, s.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, s.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, kernel_size=s.conv_kernel, groups=s.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_value_heads))
        self.norm = GatedRMSNorm(s.value_head_dim, s.eps)
        self.out_proj = nn.Linear(s.value_dim, s.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, query_start_loc: Sequence[int], slots: Sequence[int],
                states: GatedDeltaStates) -> torch.Tensor:
        """hidden [tokens, hidden_size], requests packed one after another (request i owns tokens
        query_start_loc[i]:query_start_loc[i + 1] and state slot slots[i]); the states advance in place."""
        s = self.shape
        mixed = self.in_proj_qkv(hidden)
        z = self.in_proj_z(hidden).view(-1, s.num_value_heads, s.value_head_dim)
        beta = self.in_proj_b(hidden).sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        out = torch.empty(hidden.shape[0], s.num_value_heads, s.value_head_dim, device=hidden.device, dtype=hidden.dtype)
        for i, slot in enumerate(slots):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            if end == start:
                continue
            qkv = self._conv(mixed[start:end], states.conv[slot])
            out[start:end] = self._delta_rule(qkv, beta[start:end], decay[start:end], states.recurrent[slot]).to(hidden.dtype)
        normed = self.norm(out.reshape(-1, s.value_head_dim), z.reshape(-1, s.value_head_dim))
        return self.out_proj(normed.view(hidden.shape[0], s.value_dim))

    def _conv(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv (then silu) of one request's new inputs x [n, conv_dim], continuing
        `window` [conv_dim, kernel - 1], which then holds the last kernel - 1 inputs."""
        joined = torch.cat([window, x.transpose(0, 1).to(window.dtype)], dim=-1)  # [conv_dim, kernel - 1 + n]
        window.copy_(joined[:, -window.shape[-1]:])
        conv = F.conv1d(joined.unsqueeze(0).to(self.conv1d.weight.dtype), self.conv1d.weight, groups=self.shape.conv_dim)
        return F.silu(conv[0]).transpose(0, 1).to(x.dtype)  # [n, conv_dim]

    def _delta_rule(self, qkv: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over one request's tokens, from and into `state` [Hv, Dk, Dv] (fp32).
        Returns the outputs [n, Hv, Dv] in fp32."""
        s = self.shape
        query, key, value = torch.split(qkv.float(), [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_value_heads // s.num_key_heads  # each q/k head serves `group` consecutive value heads
        query = _l2norm(query.view(-1, s.num_key_heads, s.key_head_dim)).repeat_interleave(group, dim=1) * s.key_head_dim**-0.5
        key = _l2norm(key.view(-1, s.num_key_heads, s.key_head_dim)).repeat_interleave(group, dim=1)
        value = value.view(-1, s.num_value_heads, s.value_head_dim)
        outputs = torch.empty_like(value)
        current = state.clone()
        for t in range(value.shape[0]):
            current = current * decay[t].exp()[:, None, None]
            remembered = (current * key[t][:, :, None]).sum(dim=1)  # [Hv, Dv]
            delta = (value[t] - remembered) * beta[t][:, None].float()
            current = current + key[t][:, :, None] * delta[:, None, :]
            outputs[t] = (current * query[t][:, :, None]).sum(dim=1)
        state.copy_(current)
        return outputs


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
