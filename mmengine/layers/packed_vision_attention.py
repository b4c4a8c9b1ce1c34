"""Packed vision attention: every sequence of a packed batch in one SDPA call per distinct length.

transformers' Qwen vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) pack a step's patches into
one sequence with `cu_seqlens` boundaries: one sequence per image, or, in Qwen2.5-VL's windowed
layers, one per window. Without flash-attn they call SDPA once per sequence: about 84 windows x 24
windowed layers ≈ 2,000 calls for one 1920x1080 photo, which leaves a GPU waiting on launches. A
tower whose attention implementation has "flash" in its name hands the whole packed sequence and its
boundaries to that function instead, so this module registers one under such a name: sequences of
the same length (a photo's full windows, a batch's same-sized images) go through SDPA as one batch,
so a layer makes one call per distinct length (three or four for a photo's windows). Each sequence
attends only to itself as before; the per-sequence arithmetic is SDPA's own, so outputs match the
per-window loop (bitwise on CPU in fp32, tested).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# transformers routes a vision tower's attention through `cu_seqlens` when this name contains "flash".
PACKED_ATTENTION = "mmengine_packed_flash"


@dataclass(frozen=True)
class LengthGroup:
    """The sequences of one length: `count` of them, starting at `rows` (a slice when they are adjacent)."""

    length: int
    count: int
    rows: slice | torch.Tensor


@dataclass(frozen=True)
class PackedPlan:
    total: int
    groups: tuple[LengthGroup, ...]


def plan_packed(cu_seqlens: torch.Tensor) -> PackedPlan:
    """Group a packed batch's sequences by length; empty sequences are dropped."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    groups = []
    for length, starts in starts_by_length.items():
        adjacent = all(b - a == length for a, b in zip(starts, starts[1:]))
        if adjacent:
            rows: slice | torch.Tensor = slice(starts[0], starts[0] + length * len(starts))
        else:
            offsets = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(length)
            rows = offsets.flatten().to(cu_seqlens.device)
        groups.append(LengthGroup(length, len(starts), rows))
    return PackedPlan(bounds[-1] - bounds[0] if bounds else 0, tuple(groups))


class _PlanCache:
    """A tower passes the same `cu_seqlens` tensor to each of its layers: plan it once (one host sync), not
    per layer. Keyed by the tensor object, held weakly; two entries cover Qwen2.5-VL's window and full layers."""

    def __init__(self, size: int = 4) -> None:
        self._entries: list[tuple[weakref.ref, PackedPlan]] = []
        self._size = size

    def plan(self, cu_seqlens: torch.Tensor) -> PackedPlan:
        for ref, plan in self._entries:
            if ref() is cu_seqlens:
                return plan
        plan = plan_packed(cu_seqlens)
        self._entries = [(weakref.ref(cu_seqlens), plan), *self._entries[: self._size - 1]]
        return plan


_plans = _PlanCache()


def packed_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """query/key/value [1, heads, rows, head_dim] with sequence boundaries `cu_seqlens` (rows, as in
    transformers); returns [1, rows, heads, head_dim], each sequence attending only to itself."""
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed batch, got a batch of {query.shape[0]}")
    plan = _plans.plan(cu_seqlens)
    heads, rows, head_dim = query.shape[1], query.shape[2], value.shape[-1]
    out = query.new_empty(rows, heads, head_dim)
    for group in plan.groups:
        parts = [_take(t[0], group) for t in (query, key, value)]
        done = F.scaled_dot_product_attention(*parts, scale=scaling)  # [count, heads, length, head_dim]
        done = done.transpose(1, 2).reshape(group.count * group.length, heads, head_dim)
        if isinstance(group.rows, slice):
            out[group.rows] = done
        else:
            out.index_copy_(0, group.rows, done)
    return out.unsqueeze(0)


def _take(states: torch.Tensor, group: LengthGroup) -> torch.Tensor:
    """[heads, rows, d] -> the group's sequences as a batch [count, heads, length, d]."""
    picked = states[:, group.rows] if isinstance(group.rows, slice) else states.index_select(1, group.rows)
    return picked.unflatten(1, (group.count, group.length)).transpose(0, 1)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature, for bidirectional packed vision attention only."""
    if attention_mask is not None or is_causal or dropout:
        raise ValueError("packed vision attention takes no mask, no causal flag and no dropout")
    if cu_seq_lens_q is None or (cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q
                                 and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError("packed vision attention needs the same cu_seqlens for queries and keys")
    return packed_attention(query, key, value, cu_seq_lens_q, scaling), None


def use_packed_attention(tower: torch.nn.Module) -> None:
    """Route a transformers Qwen vision tower's attention through `packed_attention_forward`. The tower gets its
    own copy of its config: the one it was built from is usually the checkpoint's, shared with the rest."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    shared = tower.config
    routed = copy.copy(shared)
    routed._attn_implementation = PACKED_ATTENTION
    for module in tower.modules():
        if getattr(module, "config", None) is shared:
            module.config = routed
