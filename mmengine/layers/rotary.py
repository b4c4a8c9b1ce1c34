"""Rotary position embedding (GPT-NeoX layout: the two halves of the head dim rotate together).

The cos/sin of every position are computed once, when the model is built, into one table that
every layer reads by position. The table holds exactly the values transformers computes per call
(`cos(pos * inv_freq) * scaling`, in float32, then rounded to the model dtype), so rotating from it
matches transformers bit for bit on the reference path.

M-RoPE (Qwen2-VL): each token has three positions (temporal, height, width), and the rotary
frequencies are split into three sections, section i rotating by position i. The table is the same;
each frequency column is read at its own section's position, which is exactly transformers' per-
channel cos/sin recomposed by section. Positions are then [tokens, 3] instead of [tokens].
Interleaved M-RoPE (Qwen3-VL): frequency j rotates by the height position when j % 3 == 1 and
j < 3 * S_h, by the width position when j % 3 == 2 and j < 3 * S_w, else by the temporal one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mmengine.errors import UnsupportedModelError
from mmengine.kernels.checks import check_positions

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


def build_cos_sin_table(inv_freq: torch.Tensor, scaling: float, max_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """[max_positions, 2 * head_dim]: each row is cos then sin of `cat(freqs, freqs)` at that position,
    computed in float32 the way transformers does, then rounded once to `dtype`."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.cat((emb.cos() * scaling, emb.sin() * scaling), dim=-1).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` in x's dtype. x: [tokens, heads, head_dim]; cos/sin:
    [tokens, 1, head_dim] in x's dtype."""
    return x * cos + rotate_half(x) * sin


def rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    mrope_section: tuple[int, ...] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fused rotary kernel computes, in PyTorch: q [T, Hq, D] and k [T, Hkv, D] rotated by the
    table rows of `positions` ([T], or [T, 3] with `mrope_section`) (returns new tensors)."""
    step = RotaryStep.gather(positions, cos_sin, use_kernel=False, mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
    return step.apply(q, k)


def mrope_columns(
    mrope_section: tuple[int, ...], head_dim: int, device: torch.device | None = None, interleaved: bool = False
) -> torch.Tensor:
    """[2 * head_dim]: which of the three positions each table column is read at (cos half, then sin half),
    made on `device` (the default device when None). It copies host values over: build it once, outside
    any CUDA graph capture (RotaryEmbedding keeps it as a buffer)."""
    half = head_dim // 2
    if len(mrope_section) != 3 or sum(mrope_section) != half:
        raise UnsupportedModelError(f"mrope_section {list(mrope_section)} must be three sizes summing to head_dim / 2 = {half}")
    if interleaved:
        per_freq = [1 if j % 3 == 1 and j < 3 * mrope_section[1] else 2 if j % 3 == 2 and j < 3 * mrope_section[2] else 0
                    for j in range(half)]
    else:
        per_freq = [channel for channel, size in enumerate(mrope_section) for _ in range(size)]
    return torch.tensor(per_freq * 4, dtype=torch.long, device=device)


@dataclass
class RotaryStep:
    """One step's rotary inputs, shared by every layer: the positions and the table, plus (on the
    reference path) the table rows of the step's positions, gathered once per step."""

    positions: torch.Tensor  # [num_tokens] int64, or [num_tokens, 3] with M-RoPE
    cos_sin: torch.Tensor  # [max_positions, 2 * head_dim], the model's table
    use_kernel: bool  # the fused Triton kernel rotates (and stores K/V); else `apply` below
    mrope_section: tuple[int, ...] | None = None  # M-RoPE: frequencies per position channel
    cos: torch.Tensor | None = None  # [num_tokens, 1, head_dim], reference path only
    sin: torch.Tensor | None = None
    mrope_interleaved: bool = False  # Qwen3-VL's layout of the sections (module docstring)

    @classmethod
    def gather(
        cls, positions: torch.Tensor, cos_sin: torch.Tensor, use_kernel: bool, mrope_section: tuple[int, ...] | None = None,
        mrope_interleaved: bool = False, columns: torch.Tensor | None = None,
    ) -> RotaryStep:
        """`columns`: M-RoPE's `mrope_columns`, already on the table's device (RotaryEmbedding keeps
        them): without them they are built here, on the host then copied over, which a CUDA graph being
        captured forbids (a model's forward passes them; only direct callers such as tests may not)."""
        if mrope_section is not None and positions.dim() != 2:
            raise ValueError(f"M-RoPE needs positions of shape [tokens, 3], got {tuple(positions.shape)}")
        if use_kernel:
            return cls(positions, cos_sin, use_kernel=True, mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
        try:
            rows = cos_sin[positions]  # [T, 2D] or [T, 3, 2D]
        except IndexError:  # (raised on a CPU; say which table was too short)
            check_positions(positions, cos_sin.shape[0])
            raise
        head_dim = cos_sin.shape[1] // 2
        if mrope_section is None:
            rows = rows[:, None, :]
        else:
            if columns is None:
                columns = mrope_columns(mrope_section, head_dim, rows.device, mrope_interleaved)
            rows = rows.gather(1, columns.view(1, 1, -1).expand(rows.shape[0], 1, -1))
        return cls(positions, cos_sin, False, mrope_section, cos=rows[..., :head_dim], sin=rows[..., head_dim:],
                   mrope_interleaved=mrope_interleaved)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference path: q and k rotated (new tensors)."""
        assert self.cos is not None and self.sin is not None, "the kernel path rotates inside the kernel"
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


class RotaryEmbedding(nn.Module):
    """Owns the cos/sin table of one rotary config; the decoder builds one and shares it across layers."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int | None = None) -> None:
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, head_dim)
        self.head_dim = head_dim
        self.mrope_section = mrope_section_of(config)
        self.mrope_interleaved = self.mrope_section is not None and mrope_interleaved_of(config)
        self.max_positions = max_positions or config.max_position_embeddings
        # Built on the current default device, rounded to the current default dtype (the model's).
        device = torch.get_default_device()
        table = build_cos_sin_table(inv_freq.to(device), self.scaling, self.max_positions, torch.get_default_dtype())
        self.register_buffer("cos_sin", table, persistent=False)
        # M-RoPE's column map (validates the sections), built once beside the table and moved with it, so that
        # a step (inside a CUDA graph being captured, too) never copies a host tensor to the device
        columns = None
        if self.mrope_section is not None:
            columns = mrope_columns(self.mrope_section, head_dim, device, self.mrope_interleaved)
        self.register_buffer("mrope_cols", columns, persistent=False)

    def step(self, positions: torch.Tensor, use_kernel: bool) -> RotaryStep:
        return RotaryStep.gather(positions, self.cos_sin, use_kernel, self.mrope_section, self.mrope_interleaved,
                                 columns=self.mrope_cols)


# Qwen3-VL's text model always uses M-RoPE, interleaved, with these sections unless its config names others
# (transformers' Qwen3VLTextRotaryEmbedding).
_QWEN3_VL_DEFAULT_SECTIONS = (24, 20, 20)
# Qwen3.5's text model: interleaved M-RoPE over its rotary part (a quarter of each head), sections (11, 11, 10)
# unless named (transformers' Qwen3_5TextRotaryEmbedding).
_DEFAULT_SECTIONS = {"qwen3_vl_text": _QWEN3_VL_DEFAULT_SECTIONS, "qwen3_vl_moe_text": _QWEN3_VL_DEFAULT_SECTIONS,
                     "qwen3_5_text": (11, 11, 10), "qwen3_5_moe_text": (11, 11, 10)}


def mrope_section_of(config: PretrainedConfig) -> tuple[int, ...] | None:
    """The config's M-RoPE sections (Qwen-VL families), or None for plain RoPE."""
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(params, dict) and params.get("mrope_section"):
            return tuple(int(n) for n in params["mrope_section"])
    return _DEFAULT_SECTIONS.get(config.model_type)


def mrope_interleaved_of(config: PretrainedConfig) -> bool:
    """Whether the sections interleave (Qwen3-VL and Qwen3.5, whatever their config's mrope_interleaved says)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return config.model_type in _DEFAULT_SECTIONS or bool(params.get("mrope_interleaved"))
