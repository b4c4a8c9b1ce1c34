"""The KV cache's device memory: one tensor per distinct layer shape and pool, one view per cached layer.

Most decoders cache every layer at one shape (KV heads x head size). Gemma 4's sliding and global
layers differ (e.g. 16 KV heads of 256 against 4 of 512), so layers are grouped by shape, each group
one tensor [its layers, 2 (K, V), blocks, block_size, KV heads, head size]. Sliding-window layers keep
their blocks in a pool of their own (kv_cache/sliding_window.py), with its own block count: a block id
means the same tokens in every layer of one pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmengine.kv_cache.manager import cdiv


class PagedKVTensors:
    def __init__(self, layout: list[tuple[int, int]], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, windowed: Sequence[bool] = (), num_window_blocks: int = 0) -> None:
        """`layout`: (KV heads, head size) of each cached layer, in order; `windowed`: which of them keep
        their blocks in the sliding-window pool of `num_window_blocks` blocks (none by default)."""
        windowed = list(windowed) or [False] * len(layout)
        keys = [(shape, window) for shape, window in zip(layout, windowed)]
        self.keys = list(dict.fromkeys(keys))
        self.groups = [torch.zeros((keys.count(key), 2, num_window_blocks if key[1] else num_blocks, block_size, *key[0]),
                                   dtype=dtype, device=device) for key in self.keys]
        self.windowed_groups = [key[1] for key in self.keys]
        seen = [0] * len(self.keys)
        self.layers: list[torch.Tensor] = []  # [2, blocks, block_size, heads, dim] each
        for key in keys:
            group = self.keys.index(key)
            self.layers.append(self.groups[group][seen[group]])
            seen[group] += 1

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        """Blocks of the full-attention pool."""
        return next(group.shape[2] for group, windowed in zip(self.groups, self.windowed_groups) if not windowed)

    @property
    def dtype(self) -> torch.dtype:
        return self.groups[0].dtype

    @property
    def _full_groups(self) -> list[torch.Tensor]:
        return [group for group, windowed in zip(self.groups, self.windowed_groups) if not windowed]

    def gather_blocks(self, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """The full-attention pool's blocks, every layer: per group [layers, 2, n, block_size, heads, dim]
        (the host tier keeps these; a sliding window is never offloaded)."""
        return [group.index_select(2, block_ids) for group in self._full_groups]

    def scatter_blocks(self, block_ids: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """Writes gather_blocks' parts back at `block_ids` (as bytes: index_copy_ has no FP8 kernel everywhere)."""
        for group, part in zip(self._full_groups, parts):
            group.view(torch.uint8).index_copy_(2, block_ids, part.to(group.device, non_blocking=True).view(torch.uint8))

    def float_values(self) -> torch.Tensor:
        """Every stored value, flattened, as float32 (for tests and checks)."""
        return torch.cat([group.float().flatten() for group in self.groups])


def kv_block_bytes(layout: list[tuple[int, int]], block_size: int, element_bytes: int) -> int:
    """Bytes of one block across every given cached layer (K and V)."""
    return 2 * block_size * element_bytes * sum(heads * dim for heads, dim in layout)


def kv_pool_bytes(layout: list[tuple[int, int]], windows: Sequence[int | None], block_size: int,
                  element_bytes: int) -> tuple[int, int]:
    """(full-attention, sliding-window) bytes of one block: the layers without a window, and those with one."""
    full = kv_block_bytes([shape for shape, w in zip(layout, windows) if w is None], block_size, element_bytes)
    return full, kv_block_bytes([shape for shape, w in zip(layout, windows) if w is not None], block_size, element_bytes)


@dataclass(frozen=True)
class WindowPool:
    """The sliding-window layers' share of the KV cache memory."""

    window: int
    ratio: float  # its blocks per block of the full-attention pool, before the minimum below
    # The null block and what one request may hold at once: its window and a full chunk. Beyond what the
    # running requests hold, the pool caches: the window before the end of each cached prefix is what
    # makes the full pool's chain a hit, so the pool is not capped at what max_num_seqs requests hold.
    min_blocks: int

    @classmethod
    def plan(cls, window: int, ratio: float, block_size: int, max_num_batched_tokens: int, max_model_len: int) -> WindowPool:
        per_request = min(cdiv(window - 1 + max_num_batched_tokens, block_size) + 1, cdiv(max_model_len, block_size))
        return cls(window, ratio, 1 + per_request)

    def blocks_for(self, num_full_blocks: int) -> int:
        return max(math.ceil(self.ratio * num_full_blocks), self.min_blocks)


def split_kv_memory(available: int, full_block_bytes: int, window_block_bytes: int, pool: WindowPool | None,
                    useful_full_blocks: int) -> tuple[int, int]:
    """(full-attention blocks, sliding-window blocks) that `available` bytes hold: the window pool takes
    its ratio of the full pool's blocks (at least its minimum), the full pool the rest."""
    if pool is None:
        return min(available // full_block_bytes, useful_full_blocks), 0
    num_full = min(int(available // (full_block_bytes + pool.ratio * window_block_bytes)), useful_full_blocks)
    num_window = pool.blocks_for(num_full)
    num_full = min(num_full, (available - num_window * window_block_bytes) // full_block_bytes)
    return int(num_full), num_window
