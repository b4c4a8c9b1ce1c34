"""LoRA on the decoder's projections: a linear layer plus a per-row low-rank delta from device slots.

    y = x W^T + b + (x A[slot]^T) B[slot]^T        for the rows of a request that runs an adapter

Fused projections keep their fusion. Each of the S slices of a fused projection (q, k, v or gate,
up) has its own pair; the slot holds them stacked: A as [S * R, in] (slice j's rows at j * R) and B
as [out, S * R], block-diagonal (slice j's output rows read only its R columns). So one shrink and
one expand serve the whole fused projection; R is max_lora_rank, and an adapter of lower rank
leaves its extra rows and columns zero. B is stored scaled (alpha / r, or alpha / sqrt(r) with
rsLoRA). The runner fills the slots (lora/slots.py keeps their books) and sets the step's segments
on the shared LoRAContext before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRASegments:
    """The step's rows that run an adapter: segment i is rows [starts[i], starts[i] + lens[i]) on slot
    slots[i] (-1: no adapter). The int32 device tensors feed the kernels; the host lists, when there
    are any, the reference. A decode CUDA graph's segments are device buffers only (one per row, the
    slots rewritten every step), so they have no host lists."""

    device_starts: torch.Tensor
    device_lens: torch.Tensor
    device_slots: torch.Tensor
    max_len: int
    starts: list[int] | None = None
    lens: list[int] | None = None
    slots: list[int] | None = None

    @classmethod
    def build(cls, starts: list[int], lens: list[int], slots: list[int], device: torch.device) -> "LoRASegments":
        packed = torch.tensor([starts, lens, slots], dtype=torch.int32).to(device)
        return cls(packed[0], packed[1], packed[2], max(lens, default=0), starts, lens, slots)

    def host_lists(self) -> tuple[list[int], list[int], list[int]]:
        if self.starts is not None:
            return self.starts, self.lens, self.slots
        return self.device_starts.tolist(), self.device_lens.tolist(), self.device_slots.tolist()


class LoRAContext:
    """Shared by every LoRALinear of the language model: the current step's segments (None: no
    adapter rows) and whether the Triton kernels or the PyTorch reference compute the deltas."""

    def __init__(self) -> None:
        self.segments: LoRASegments | None = None
        self.use_kernels = False

    def segments_for(self, x: torch.Tensor) -> LoRASegments | None:
        return self.segments


class ItemLoRAContext(LoRAContext):
    """Shared by the LoRALinears of the vision side, whose rows are an encoder batch's items: `items`
    holds each item's adapter slot (-1: none) and its share of the rows (its patch count, or 1 for a
    [batch, patches, dim] input); a layer's rows split in those proportions, so a merger that
    pools 4 patches into one row splits the same way. Every layer with the same row count gets the
    same segments, so they are built once per row count (and per encoder batch)."""

    def __init__(self) -> None:
        super().__init__()
        self._items: list[tuple[int, int]] | None = None
        self._built: dict[int, LoRASegments | None] = {}  # row count -> segments, for the current items

    @property
    def items(self) -> list[tuple[int, int]] | None:
        return self._items

    @items.setter
    def items(self, items: list[tuple[int, int]] | None) -> None:
        self._items = items
        self._built = {}

    def segments_for(self, x: torch.Tensor) -> LoRASegments | None:
        if not self._items:
            return None
        num_rows = x.numel() // x.shape[-1]
        if num_rows not in self._built:
            self._built[num_rows] = self._split(num_rows, x.device)
        return self._built[num_rows]

    def _split(self, num_rows: int, device: torch.device) -> LoRASegments | None:
        total = sum(rows for _, rows in self._items)
        starts, lens, slots, row = [], [], [], 0
        for slot, rows in self._items:
            length = rows * num_rows // total
            if slot >= 0:
                starts.append(row)
                lens.append(length)
                slots.append(slot)
            row += length
        return LoRASegments.build(starts, lens, slots, device) if starts else None


@dataclass(frozen=True)
class LoRASlice:
    name: str  # the checkpoint's projection name (q_proj, gate_proj, ...)
    offset: int  # first output row of the slice in the fused projection
    size: int


class LoRALinear(nn.Linear):
    """An nn.Linear (sharing the original's parameters) with `max_loras` adapter slots."""

    def __init__(self, linear: nn.Linear, slices: list[LoRASlice], context: LoRAContext, max_loras: int, max_rank: int) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight = linear.weight
        self.bias = linear.bias
        self.slices = slices
        self.context = context
        self.max_rank = max_rank
        width = len(slices) * max_rank
        factory = {"dtype": linear.weight.dtype, "device": linear.weight.device}
        self.register_buffer("lora_a", torch.zeros(max_loras, width, self.in_features, **factory), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, width, **factory), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        segments = self.context.segments_for(x)
        if segments is None:
            return y
        rows = y.reshape(-1, self.out_features)  # [batch, patches, dim] inputs (vision towers) as rows
        add_lora(rows, x.reshape(-1, self.in_features), self.lora_a, self.lora_b, segments, self.context.use_kernels)
        return rows.view(y.shape)

    def load_slot(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes one adapter's pairs (slice name -> (A [r, in], scaled B [size, r])) into `slot`;
        slices the adapter does not target stay zero."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for j, piece in enumerate(self.slices):
            pair = pairs.get(piece.name)
            if pair is None:
                continue
            lora_a, lora_b = pair
            rank = lora_a.shape[0]
            a[j * self.max_rank : j * self.max_rank + rank].copy_(lora_a)
            b[piece.offset : piece.offset + piece.size, j * self.max_rank : j * self.max_rank + rank].copy_(lora_b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, segments: LoRASegments, use_kernels: bool) -> None:
    """y[rows] += (x[rows] @ lora_a[slot].T) @ lora_b[slot].T for each segment, in place."""
    x = x.contiguous()
    if use_kernels:
        from mmengine.kernels.lora import segmented_matmul

        shrunk = torch.empty(x.shape[0], lora_a.shape[1], dtype=x.dtype, device=x.device)
        args = (segments.device_starts, segments.device_lens, segments.device_slots, segments.max_len)
        segmented_matmul(x, lora_a, shrunk, *args, accumulate=False)
        segmented_matmul(shrunk, lora_b, y, *args, accumulate=True)
        return
    lora_reference(y, x, lora_a, lora_b, segments)


def lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, segments: LoRASegments) -> None:
    """The PyTorch reference of add_lora (the CPU path): the same shrink, then expand-and-add, per segment."""
    for start, length, slot in zip(*segments.host_lists()):
        if slot < 0:
            continue
        rows = slice(start, start + length)
        shrunk = (x[rows].float() @ lora_a[slot].float().T).to(x.dtype)
        y[rows] = (y[rows].float() + shrunk.float() @ lora_b[slot].float().T).to(y.dtype)
