"""Tile shapes the kernels launch with, which host-side layouts must match (plain numbers, no Triton
import, so the layouts are planned on any machine)."""

from __future__ import annotations

# Query rows one tile of the cascade prefix pass (and of the prefill kernel) holds: tokens x the query
# heads of one KV head. The host plan counts tiles with it; the kernel launches with it.
TILE_ROWS = 64


class CascadeTileMismatch(ValueError):
    """A cascade layout's tiles were planned for another GQA group than the kernel's (the layer names itself)."""


def tokens_per_tile(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per tile: TILE_ROWS over the GQA group padded to a power of two."""
    group_pad = 1 << max(0, (num_heads // num_kv_heads - 1).bit_length())
    return max(1, TILE_ROWS // group_pad)
