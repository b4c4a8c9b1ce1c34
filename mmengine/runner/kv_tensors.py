"""The KV cache's device memory: one tensor per distinct layer shape, one view per cached layer.

Most decoders cache every layer at one shape (KV heads x head size). Gemma 4's sliding and global
layers differ (e.g. 16 KV heads of 256 against 4 of 512), so layers are grouped by shape, each group
one tensor [its layers, 2 (K, V), blocks, block_size, KV heads, head size]. Every group has the same
blocks: a block id means the same tokens in every layer.
"""

from __future__ import annotations

import torch


class PagedKVTensors:
    def __init__(self, layout: list[tuple[int, int]], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """`layout`: (KV heads, head size) of each cached layer, in order."""
        self.shapes = list(dict.fromkeys(layout))
        self.groups = [torch.zeros((layout.count(shape), 2, num_blocks, block_size, *shape), dtype=dtype, device=device)
                       for shape in self.shapes]
        seen = [0] * len(self.shapes)
        self.layers: list[torch.Tensor] = []  # [2, blocks, block_size, heads, dim] each
        for shape in layout:
            group = self.shapes.index(shape)
            self.layers.append(self.groups[group][seen[group]])
            seen[group] += 1

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return self.groups[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.groups[0].dtype

    def gather_blocks(self, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """The blocks' K/V of every layer: per group [layers, 2, n, block_size, heads, dim]."""
        return [group.index_select(2, block_ids) for group in self.groups]

    def scatter_blocks(self, block_ids: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """Writes gather_blocks' parts back at `block_ids` (as bytes: index_copy_ has no FP8 kernel everywhere)."""
        for group, part in zip(self.groups, parts):
            group.view(torch.uint8).index_copy_(2, block_ids, part.to(group.device, non_blocking=True).view(torch.uint8))

    def float_values(self) -> torch.Tensor:
        """Every stored value, flattened, as float32 (for tests and checks)."""
        return torch.cat([group.float().flatten() for group in self.groups])


def kv_block_bytes(layout: list[tuple[int, int]], block_size: int, element_bytes: int) -> int:
    """Bytes of one block across every cached layer (K and V)."""
    return 2 * block_size * element_bytes * sum(heads * dim for heads, dim in layout)
