"""Host-side checks of kernel arguments, shared by each kernel and its PyTorch reference (no Triton here,
so the reference path imports it on any machine)."""

from __future__ import annotations

import torch


def check_positions(positions: torch.Tensor, max_positions: int) -> None:
    """Every position has a row in a table of `max_positions` (CPU tensors only: it reads them)."""
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= max_positions):
        raise IndexError(
            f"positions span [{int(positions.min())}, {int(positions.max())}] but the rotary table covers [0, {max_positions})"
        )
