"""Verify steps of speculative decoding in CUDA graphs.

A verify step is decode-shaped: each request computes its last token and the drafts after it, at
most num_speculative_tokens + 1 tokens. A graph of R requests holds R * (k + 1) token rows. The
step's real tokens are packed as in an eager step (a request with fewer drafts, or none, takes
fewer rows), then come the padding requests (one row each, as in a decode graph) and rows that
belong to no request; none of them stores K/V. Everything that varies lives in device buffers the
kernels read: token rows, slots, query offsets, context lengths and block tables. The attention
runs every request through the varlen prefill kernel, whose grid depends only on R and k + 1.

A hybrid model's linear-attention layers run the tokens one column at a time, as an eager verify
step does (layers/gated_delta.py `_stepwise_rows`): column j holds every request's j-th token row
and live slot (a request without a j-th token points at a padding row and the scratch slot), and
after column j each state is copied into its draft slot (the state after j + 1 tokens) so that a
rejection can restore it. Checkpoint saves are copied after the replay from those draft slots.
"""

from __future__ import annotations

import numpy as np
import torch

from mmengine.core.scheduler import ScheduledRequest
from mmengine.layers.attention import AttentionMetadata


def verify_graph_sizes(sizes: list[int], query_len: int, max_tokens: int) -> list[int]:
    """The decode buckets whose verify graph fits the step's token buffers."""
    return [size for size in sizes if size * query_len <= max_tokens]


def verify_query_len(scheduled: list[ScheduledRequest], graph_query_len: int) -> int | None:
    """The tokens a request a verify graph needs for this step (the most any request computes), or None
    when a request's chunk is not a decode or a verify (a prompt chunk runs eager: its states and
    checkpoints take the varlen path) or needs more than the graph holds."""
    longest = 1
    for s in scheduled:
        if s.num_new_tokens != 1 + len(s.draft_token_ids) or s.num_new_tokens > graph_query_len:
            return None
        longest = max(longest, s.num_new_tokens)
    return longest


def verify_metadata(size: int, query_len: int, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, window_slot_mapping: torch.Tensor | None,
                    window_block_tables: torch.Tensor | None) -> AttentionMetadata:
    """The metadata a verify graph is captured with: no decode rows (every request goes to the prefill
    kernel), a grid fixed by size and query_len. The host lists are what the torch reference reads; the
    CPU stand-in rewrites them before each replay (refresh_host_lists), the Triton kernels never read them."""
    return AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        window_slot_mapping=window_slot_mapping, window_block_tables=window_block_tables,
        query_lens_cpu=[query_len] * size, seq_lens_cpu=[query_len] * size,
        query_start_loc_cpu=list(range(0, size * query_len + 1, query_len)),
        num_decodes=0, max_decode_seq_len=0, max_prefill_query_len=query_len,
    )


def refresh_host_lists(captured: AttentionMetadata, step: AttentionMetadata) -> None:
    """Copies this step's host lists into a captured metadata (in place: the captured step holds it)."""
    for name in ("query_lens_cpu", "seq_lens_cpu", "query_start_loc_cpu"):
        getattr(captured, name)[:] = getattr(step, name)


def state_source(s: ScheduledRequest, position: int) -> int:
    """The slot holding a verify step's state at `position` after the replay: the live slot at the chunk's
    end, else the draft slot the step saved it in."""
    if position == s.start + s.num_new_tokens:
        return s.state.slot
    return dict(s.state.draft_saves)[position]


class RecurrentColumns:
    """The linear-attention layers' view of a verify graph (module docstring), in device buffers."""

    def __init__(self, max_reqs: int, query_len: int, scratch_slot: int, device: torch.device) -> None:
        self.query_len = query_len
        self.scratch_slot = scratch_slot
        self.rows = torch.zeros(query_len, max_reqs, dtype=torch.long, device=device)
        self.slots = torch.full((query_len, max_reqs), scratch_slot, dtype=torch.long, device=device)
        self.saves = torch.full((max(query_len - 1, 1), max_reqs), scratch_slot, dtype=torch.long, device=device)

    def views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.rows[:, :size], self.slots[:, :size], self.saves[: self.query_len - 1, :size]

    def fill(self, scheduled: list[ScheduledRequest], query_start_loc: list[int], size: int) -> None:
        """Writes the step's columns for a graph of `size` requests: the padding ones, and the columns a
        request has no token in, read the last row and keep the scratch slot. Copied from fresh host
        arrays, which the copies have read when they return, so the next step may rewrite nothing early."""
        rows = np.full((self.query_len, size), size * self.query_len - 1, dtype=np.int64)
        slots = np.full((self.query_len, size), self.scratch_slot, dtype=np.int64)
        saves = np.full((self.saves.shape[0], size), self.scratch_slot, dtype=np.int64)
        for r, s in enumerate(scheduled):
            rows[: s.num_new_tokens, r] = np.arange(query_start_loc[r], query_start_loc[r] + s.num_new_tokens)
            slots[: s.num_new_tokens, r] = s.state.slot
            for j, (_, slot) in enumerate(s.state.draft_saves):  # the state after j + 1 tokens
                saves[j, r] = slot
        for buffer, values in ((self.rows, rows), (self.slots, slots), (self.saves, saves)):
            buffer[:, :size].copy_(torch.from_numpy(values))

    def fill_padding(self, size: int) -> None:
        """Every request a padding one (for the capture)."""
        self.fill([], [], size)
