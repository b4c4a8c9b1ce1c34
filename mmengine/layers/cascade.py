"""Cascade (shared-prefix) attention: the step layout both backends read.

Requests whose block tables start with the same physical KV blocks form a group. A group's query
tokens, from all its members, attend to the shared prefix together (its K/V read once per tile of
rows instead of once per request); every request attends to its own keys after the prefix on its
own; the two partial states are merged through their log-sum-exps.

The prefix pass masks causally by each query's position, so a query that still lies inside the
prefix (a last prompt token recomputed after a full prefix hit, or any chunk that starts before
the prefix ends) never sees a later prefix key. The suffix pass reads a request's block table
with the prefix blocks cut off and a context shortened by the prefix: the prefix is whole blocks,
so the existing paged kernels run on it unchanged, their positions shifted by the prefix.

The prefix pass's work is a list of tiles (up to tile_tokens of one group's tokens each), each
cut into the same number of splits; its counts travel to the device with the layout, so the
kernels' grids only need bounds (kernels/cascade_attention.py), and a CUDA graph can hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmengine.kernels.tiling import tokens_per_tile  # noqa: F401  (the layout's tile size is the kernel's)

@dataclass
class CascadeGroup:
    """Batch rows (requests, in packed order) that share their first `num_prefix_blocks` KV blocks."""

    rows: list[int]
    num_prefix_blocks: int


@dataclass
class CascadeLayout:
    """Host arrays of a step's cascade layout (the runner copies them into persistent buffers)."""

    token_indices: np.ndarray  # [T] grouped tokens' rows in the packed batch, group after group
    token_positions: np.ndarray  # [T] their positions in their sequences (for the causal mask)
    group_starts: np.ndarray  # [G + 1] offsets of each group's tokens in token_indices
    prefix_lens: np.ndarray  # [G] shared keys, a multiple of the block size
    group_leaders: np.ndarray  # [G] a member's batch row: the first blocks of its table are the prefix
    suffix_seq_lens: np.ndarray  # [R] keys after each request's shared prefix (its whole context if ungrouped)
    suffix_block_tables: np.ndarray  # [R, W] each request's block table without its shared prefix blocks
    tile_groups: np.ndarray  # [N] the group of each tile of the prefix pass (tile_tokens of one group's tokens)
    tile_starts: np.ndarray  # [N] each tile's first token, an offset into token_indices
    tile_tokens: int  # grouped tokens one tile holds (tokens_per_tile)
    num_splits: int  # the prefix pass cuts each group's prefix into this many slices

    @property
    def num_work(self) -> int:
        """Programs of the prefix pass per KV head: one per tile and split."""
        return len(self.tile_groups) * self.num_splits


def count_tiles(groups: Sequence[CascadeGroup], query_lens: Sequence[int], tile_tokens: int) -> int:
    return int(sum(-(-sum(query_lens[r] for r in g.rows) // tile_tokens) for g in groups))


def layout_cascade(
    groups: Sequence[CascadeGroup],
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    tile_tokens: int,
    num_splits: int = 1,
) -> CascadeLayout:
    """block_tables [R, W] (rows padded with valid block ids); query_lens, seq_lens [R]."""
    num_reqs = len(query_lens)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    rows = np.array([row for g in groups for row in g.rows], dtype=np.int64)
    cuts = np.zeros(num_reqs, dtype=np.int64)  # prefix blocks of each row's group (0: ungrouped)
    cuts[rows] = np.repeat([g.num_prefix_blocks for g in groups], [len(g.rows) for g in groups]).astype(np.int64)
    # every grouped row's tokens, in group order: batch row and position of each
    lens = query_lens[rows]
    first = np.cumsum(lens) - lens
    offset = np.arange(int(lens.sum())) - np.repeat(first, lens)
    token_starts = np.cumsum(query_lens) - query_lens
    token_indices = np.repeat(token_starts[rows], lens) + offset
    token_positions = np.repeat(seq_lens[rows] - lens, lens) + offset
    sizes = np.array([int(query_lens[g.rows].sum()) for g in groups], dtype=np.int64)
    group_starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    tiles_per_group = -(-sizes // tile_tokens)
    tile_groups = np.repeat(np.arange(len(groups)), tiles_per_group)
    tile_index = np.arange(len(tile_groups)) - np.repeat(np.cumsum(tiles_per_group) - tiles_per_group, tiles_per_group)
    width = block_tables.shape[1]
    columns = np.minimum(np.arange(width)[None, :] + cuts[:, None], width - 1)
    return CascadeLayout(
        token_indices=token_indices,
        token_positions=token_positions,
        group_starts=group_starts,
        prefix_lens=np.array([g.num_prefix_blocks * block_size for g in groups], dtype=np.int64),
        group_leaders=np.array([g.rows[0] for g in groups], dtype=np.int64),
        suffix_seq_lens=seq_lens - cuts * block_size,
        suffix_block_tables=np.take_along_axis(block_tables[:num_reqs], columns, axis=1),
        tile_groups=tile_groups.astype(np.int64),
        tile_starts=(group_starts[tile_groups] + tile_index * tile_tokens).astype(np.int64),
        tile_tokens=tile_tokens,
        num_splits=num_splits,
    )


DEVICE_ARRAYS = ("token_indices", "token_positions", "group_starts", "prefix_lens", "group_leaders",
                 "suffix_seq_lens", "suffix_block_tables", "tile_groups", "tile_starts")


@dataclass
class CascadeMetadata:
    """The device tensors of a CascadeLayout (int32), its host copies, and the launch bounds.

    `counts` holds [prefix-pass programs per KV head (tiles x splits), splits, grouped tokens] on
    the device: the kernels read them there, so a CUDA graph launched with fixed grids (max_work
    programs per KV head, max_tokens merge programs, partial states for max_splits) replays on
    any layout within those bounds. An eager step's bounds are its own counts."""

    token_indices: torch.Tensor
    token_positions: torch.Tensor
    group_starts: torch.Tensor
    prefix_lens: torch.Tensor
    group_leaders: torch.Tensor
    suffix_seq_lens: torch.Tensor
    suffix_block_tables: torch.Tensor
    tile_groups: torch.Tensor
    tile_starts: torch.Tensor
    counts: torch.Tensor
    token_indices_cpu: list[int]
    token_positions_cpu: list[int]
    group_starts_cpu: list[int]
    prefix_lens_cpu: list[int]
    group_leaders_cpu: list[int]
    suffix_seq_lens_cpu: list[int]
    tile_tokens: int
    max_work: int
    max_tokens: int
    max_splits: int

    @property
    def num_groups(self) -> int:
        return len(self.prefix_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return len(self.token_indices_cpu)

    def group_sizes(self) -> list[int]:
        starts = self.group_starts_cpu
        return [starts[g + 1] - starts[g] for g in range(self.num_groups)]

    @classmethod
    def from_layout(cls, layout: CascadeLayout, device: torch.device) -> CascadeMetadata:
        """One-off device copies (the runner fills persistent buffers instead)."""

        def dev(array: np.ndarray | list[int]) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(array), dtype=torch.int32).to(device)

        return cls(
            **{name: dev(getattr(layout, name)) for name in DEVICE_ARRAYS},
            counts=dev(layout_counts(layout)),
            **host_lists(layout),
            **launch_bounds(layout),
        )


def layout_counts(layout: CascadeLayout) -> list[int]:
    return [layout.num_work, layout.num_splits, len(layout.token_indices)]


def launch_bounds(layout: CascadeLayout) -> dict[str, int]:
    """An eager step's grids: exactly its own work."""
    return {"max_work": layout.num_work, "max_tokens": len(layout.token_indices), "max_splits": layout.num_splits}


def host_lists(layout: CascadeLayout) -> dict[str, list[int] | int]:
    return {
        "token_indices_cpu": layout.token_indices.tolist(),
        "token_positions_cpu": layout.token_positions.tolist(),
        "group_starts_cpu": layout.group_starts.tolist(),
        "prefix_lens_cpu": layout.prefix_lens.tolist(),
        "group_leaders_cpu": layout.group_leaders.tolist(),
        "suffix_seq_lens_cpu": layout.suffix_seq_lens.tolist(),
        "tile_tokens": layout.tile_tokens,
    }
