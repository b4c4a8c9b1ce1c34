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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Query rows one tile of the prefix pass (and of the prefill kernel) holds: tokens x the query
# heads of one KV head. The host plan counts tiles with it; the kernel launches with it.
TILE_ROWS = 64


def tokens_per_tile(num_heads: int, num_kv_heads: int) -> int:
    group_pad = 1 << max(0, (num_heads // num_kv_heads - 1).bit_length())
    return max(1, TILE_ROWS // group_pad)


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


def layout_cascade(
    groups: Sequence[CascadeGroup],
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
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
    sizes = [int(query_lens[g.rows].sum()) for g in groups]
    width = block_tables.shape[1]
    columns = np.minimum(np.arange(width)[None, :] + cuts[:, None], width - 1)
    return CascadeLayout(
        token_indices=token_indices,
        token_positions=token_positions,
        group_starts=np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
        prefix_lens=np.array([g.num_prefix_blocks * block_size for g in groups], dtype=np.int64),
        group_leaders=np.array([g.rows[0] for g in groups], dtype=np.int64),
        suffix_seq_lens=seq_lens - cuts * block_size,
        suffix_block_tables=np.take_along_axis(block_tables[:num_reqs], columns, axis=1),
    )


@dataclass
class CascadeMetadata:
    """The device tensors of a CascadeLayout (int32) and the host copies the launchers size grids with."""

    token_indices: torch.Tensor
    token_positions: torch.Tensor
    group_starts: torch.Tensor
    prefix_lens: torch.Tensor
    group_leaders: torch.Tensor
    suffix_seq_lens: torch.Tensor
    suffix_block_tables: torch.Tensor
    token_indices_cpu: list[int]
    token_positions_cpu: list[int]
    group_starts_cpu: list[int]
    prefix_lens_cpu: list[int]
    group_leaders_cpu: list[int]
    suffix_seq_lens_cpu: list[int]

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

        def dev(array: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(array), dtype=torch.int32).to(device)

        return cls(
            token_indices=dev(layout.token_indices),
            token_positions=dev(layout.token_positions),
            group_starts=dev(layout.group_starts),
            prefix_lens=dev(layout.prefix_lens),
            group_leaders=dev(layout.group_leaders),
            suffix_seq_lens=dev(layout.suffix_seq_lens),
            suffix_block_tables=dev(layout.suffix_block_tables),
            **host_lists(layout),
        )


def host_lists(layout: CascadeLayout) -> dict[str, list[int]]:
    return {
        "token_indices_cpu": layout.token_indices.tolist(),
        "token_positions_cpu": layout.token_positions.tolist(),
        "group_starts_cpu": layout.group_starts.tolist(),
        "prefix_lens_cpu": layout.prefix_lens.tolist(),
        "group_leaders_cpu": layout.group_leaders.tolist(),
        "suffix_seq_lens_cpu": layout.suffix_seq_lens.tolist(),
    }
