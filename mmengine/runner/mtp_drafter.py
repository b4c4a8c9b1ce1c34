"""Drafts with the checkpoint's multi-token-prediction head (models/qwen3_5_mtp.py), after each step.

The runner remembers a step's final hidden states, positions and slots; once the scheduler has booked
the step (so each request's kept positions and the token after them are known), `propose` runs:

1. The head over every position the step kept, each row reading the target's hidden state there and
   the next token's embedding. This fills the head's own K/V for those positions, as the target's
   forward filled the target's, so the head's context follows the request through chunked prefill,
   prefix hits (a cached block holds the head's K/V too) and verify steps (rejected positions are
   written again by the next step). It runs for every request, drafting or not.
2. For each request that drafts: its last kept row's output gives the first draft (greedy), and each
   further draft comes from one more head step over the previous draft at the next position, which writes
   K/V past the request's computed positions, into blocks the step loop took ahead for it (the next
   verify step writes those positions again).

The drafts only ever change how many tokens a step keeps, never which: a verify step samples every position
with the target (spec/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmengine.core.scheduler import ScheduledRequest
from mmengine.layers.attention import AttentionMetadata
from mmengine.layers.kernel_dispatch import use_fused_kernels


@dataclass
class TargetStep:
    """What the head needs of the target's last step (device views, valid until the next step's inputs)."""

    hidden: torch.Tensor  # [rows, hidden] the final hidden states, after the decoder's norm
    positions: torch.Tensor  # [rows] or [rows, 3] (M-RoPE)
    slot_mapping: torch.Tensor  # [rows]
    block_tables: torch.Tensor  # [requests, max_blocks]
    scheduled: list[ScheduledRequest]  # in packed order
    query_start_loc: list[int]


@dataclass
class _Rows:
    """Requests' rows of the head's pass over kept positions, in its packed order (one-row requests first)."""

    scheduled: list[ScheduledRequest]
    batch_rows: list[int]  # each request's row in the target step's block tables
    first_rows: list[int]  # each request's first row in the target step
    counts: list[int]  # each request's kept positions


class MtpDrafter:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.model = runner.model
        self.head = runner.model.mtp
        self.block_size = runner.block_size
        self.step: TargetStep | None = None
        self.num_head_rows = 0  # rows the head computed, kept positions and chained drafts together

    def remember(self, hidden: torch.Tensor, inputs) -> None:
        metadata = inputs.metadata
        self.step = TargetStep(hidden, inputs.positions, metadata.slot_mapping, metadata.block_tables, inputs.scheduled,
                               metadata.query_start_loc_cpu)

    def forget(self) -> None:
        self.step = None

    @torch.inference_mode()
    def propose(self, wanted: dict[str, int], block_tables: dict[str, list[int]]) -> dict[str, list[int]]:
        """Runs the head after the booked step; returns up to wanted[request_id] drafts for each request that
        asks (a request drafts once its next token is its only uncomputed one), fewer where its blocks
        (block_tables, with the ones taken ahead) end."""
        step, self.step = self.step, None
        if step is None:
            return {}
        rows = self._kept_rows(step)
        if not rows.scheduled:
            return {}
        out = self._run_kept(step, rows)
        drafting = [i for i, s in enumerate(rows.scheduled)
                    if wanted.get(s.request.request_id, 0) > 0 and s.request.num_tokens - s.request.num_computed_tokens == 1]
        if not drafting:
            return {}
        last_rows = np.cumsum(rows.counts) - 1
        hidden = out[torch.as_tensor(last_rows[drafting], device=out.device)]
        positions = step.positions.index_select(0, torch.as_tensor(
            [rows.first_rows[i] + rows.counts[i] - 1 for i in drafting], device=step.positions.device))
        requests = [rows.scheduled[i].request for i in drafting]
        tokens = self._greedy(hidden)
        drafts = {r.request_id: [t] for r, t in zip(requests, tokens)}
        for depth in range(1, max(wanted[r.request_id] for r in requests)):
            # draft `depth` predicts from the previous draft, one position on
            live = [i for i, r in enumerate(requests) if len(drafts[r.request_id]) == depth and depth < wanted[r.request_id]
                    and r.num_computed_tokens + depth - 1 < len(block_tables[r.request_id]) * self.block_size]
            if not live:
                break
            index = torch.as_tensor(live, device=hidden.device)
            hidden, positions = hidden.index_select(0, index), positions.index_select(0, index.to(positions.device)) + 1
            requests = [requests[i] for i in live]
            ids = [drafts[r.request_id][-1] for r in requests]
            hidden = self._run_chained(requests, ids, hidden, positions, block_tables, depth)
            for r, t in zip(requests, self._greedy(hidden)):
                drafts[r.request_id].append(t)
        return drafts

    def _kept_rows(self, step: TargetStep) -> _Rows:
        found = []
        for batch_row, s in enumerate(step.scheduled):
            request = s.request
            kept = min(request.num_computed_tokens - s.start, s.num_new_tokens)
            if request.is_finished or kept <= 0:
                continue
            found.append((kept != 1, batch_row, s, kept))
        found.sort(key=lambda f: f[0])  # one-row requests first: the attention takes them as decodes
        return _Rows([f[2] for f in found], [f[1] for f in found], [step.query_start_loc[f[1]] for f in found],
                     [f[3] for f in found])

    def _run_kept(self, step: TargetStep, rows: _Rows) -> torch.Tensor:
        """The head over each request's kept positions: row j reads the target's hidden state at j and the
        embedding of the token at j+1 (a picture's, inside one)."""
        device = step.hidden.device
        index = torch.as_tensor(np.concatenate([np.arange(f, f + n) for f, n in zip(rows.first_rows, rows.counts)]), device=device)
        next_ids = [t for s, n in zip(rows.scheduled, rows.counts) for t in s.request.all_token_ids[s.start + 1 : s.start + n + 1]]
        shifted = [ScheduledRequest(s.request, s.start + 1, n, []) for s, n in zip(rows.scheduled, rows.counts)]
        embeds, _ = self.runner._embed(torch.as_tensor(next_ids, device=device), shifted, missing_ok=True)
        starts = [s.start for s in rows.scheduled]
        metadata = _metadata(step.slot_mapping.index_select(0, index), step.block_tables.index_select(
            0, torch.as_tensor(rows.batch_rows, device=step.block_tables.device)), rows.counts,
            [start + n for start, n in zip(starts, rows.counts)])
        return self._head(embeds, step.hidden.index_select(0, index), step.positions.index_select(0, index.to(step.positions.device)),
                          metadata, 0)

    def _run_chained(self, requests: list, ids: list[int], hidden: torch.Tensor, positions: torch.Tensor,
                     block_tables: dict[str, list[int]], depth: int) -> torch.Tensor:
        """One head step for each request, one position past the last: the previous draft's embedding and
        the head's own output there."""
        device = hidden.device
        bs = self.block_size
        contexts = [r.num_computed_tokens + depth for r in requests]  # the row's position + 1
        tables = [block_tables[r.request_id] for r in requests]
        slots = [table[(n - 1) // bs] * bs + (n - 1) % bs for table, n in zip(tables, contexts)]
        width = max(len(t) for t in tables)
        table = torch.zeros((len(tables), width), dtype=torch.int32)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.int32)
        metadata = _metadata(torch.as_tensor(slots, dtype=torch.int64, device=device), table.to(device), [1] * len(requests), contexts)
        embeds = self.model.language_model.embed_tokens(torch.as_tensor(ids, device=device))
        return self._head(embeds, hidden, positions, metadata, depth)

    def _head(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
              depth: int) -> torch.Tensor:
        self.num_head_rows += len(embeds)
        decoder = self.model.language_model
        backend = self.head.attention_layers()[0].backend
        rotary = decoder.rotary.step(positions, use_kernel=False)
        return self.head(embeds.to(hidden.dtype), hidden, rotary, metadata, depth, use_fused_kernels(embeds.device, backend.name))

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()


def _metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    """A batch of requests, one-row ones first, each its query_lens rows ending at position seq_lens - 1."""
    device = slot_mapping.device
    query_start_loc = [0, *np.cumsum(query_lens).tolist()]
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.as_tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.as_tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=query_start_loc,
        num_decodes=num_decodes,
        max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
        max_prefill_query_len=max(query_lens[num_decodes:], default=0),
    )
