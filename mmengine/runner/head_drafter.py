"""Drafts with a draft head after each step: Qwen3.5's own MTP head (models/qwen3_5_mtp.py) or an EAGLE-3
head (models/eagle3.py), both one decoder layer that reads the target's hidden states.

The runner remembers a step's hidden states (the final ones, and for EAGLE-3 the inputs of three layers),
positions and slots; once the scheduler has booked the step (so each request's kept positions and the token
after them are known), `propose` runs:

1. The head over every position the step kept, each row reading the target's hidden state there and
   the next token's embedding. This fills the head's own K/V for those positions, as the target's
   forward filled the target's, so the head's context follows the request through chunked prefill,
   prefix hits (a cached block holds the head's K/V too) and verify steps (rejected positions are
   written again by the next step). It runs for every request, drafting or not.
2. For each request that drafts: its last kept row's output gives the first draft (greedy), and each
   further draft comes from one more head step over the previous draft at the next position, fed the
   head's own hidden state, which writes K/V past the request's computed positions, into blocks the step
   loop took ahead for it (the next verify step writes those positions again).

The drafts only ever change how many tokens a step keeps, never which: a verify step samples every position
with the target (spec/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from mmengine.core.scheduler import ScheduledRequest
from mmengine.layers.attention import AttentionMetadata


@dataclass
class TargetStep:
    """What the head needs of the target's last step (device views, valid until the next step's inputs)."""

    hidden: torch.Tensor  # [rows, width] the head's input hidden state per row (DraftHead.target_hidden)
    positions: torch.Tensor  # [rows] or [rows, 3] (M-RoPE)
    slot_mapping: torch.Tensor  # [rows]
    block_tables: torch.Tensor  # [requests, max_blocks]
    scheduled: list[ScheduledRequest]  # in packed order
    query_start_loc: list[int]


class DraftHead(Protocol):
    """A draft head as HeadDrafter drives it."""

    def target_hidden(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The step's per-row input to the head (a view or copy that outlives the next forward's start)."""

    def embed(self, token_ids: torch.Tensor, spans: list[ScheduledRequest]) -> torch.Tensor:
        """Embeddings of the tokens at the spans' positions (a picture's placeholders: its embeddings, where
        the head reads them)."""

    def embed_drafts(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                draft_step: int, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(the output the logits read, the hidden state the next draft step reads)."""

    def greedy(self, output: torch.Tensor) -> torch.Tensor:
        """Each row's most likely next token, in the target's vocabulary (on the device: the drafter reads every
        draft of a step back at once)."""

    def attention_layers(self) -> list:
        """The head's attention layers, whose K/V the KV cache keeps after the target's."""


@dataclass
class _Rows:
    """Requests' rows of the head's pass over kept positions, in its packed order (one-row requests first)."""

    scheduled: list[ScheduledRequest]
    batch_rows: list[int]  # each request's row in the target step's block tables
    first_rows: list[int]  # each request's first row in the target step
    counts: list[int]  # each request's kept positions


class HeadDrafter:
    def __init__(self, head: DraftHead, block_size: int) -> None:
        self.head = head
        self.block_size = block_size
        self.step: TargetStep | None = None
        self.num_head_rows = 0  # rows the head computed, kept positions and chained drafts together

    def remember(self, final_hidden: torch.Tensor, inputs) -> None:
        metadata = inputs.metadata
        self.step = TargetStep(self.head.target_hidden(final_hidden), inputs.positions, metadata.slot_mapping,
                               metadata.block_tables, inputs.scheduled, metadata.query_start_loc_cpu)

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
        out, chain = self._run_kept(step, rows)
        drafting = [i for i, s in enumerate(rows.scheduled)
                    if wanted.get(s.request.request_id, 0) > 0 and s.request.num_tokens - s.request.num_computed_tokens == 1]
        if not drafting:
            return {}
        last = torch.as_tensor((np.cumsum(rows.counts) - 1)[drafting], device=out.device)
        out, hidden = out.index_select(0, last), chain.index_select(0, last)
        positions = step.positions.index_select(0, torch.as_tensor(
            [rows.first_rows[i] + rows.counts[i] - 1 for i in drafting], device=step.positions.device))
        first = requests = [rows.scheduled[i].request for i in drafting]
        ids = self.head.greedy(out)  # each request's first draft, left on the device
        order = list(range(len(first)))  # each chained row's request, by its index in `first`
        columns = [(order, ids)]
        for depth in range(1, max(wanted[r.request_id] for r in requests)):
            # draft `depth` predicts from the previous draft, one position on
            live = [i for i, r in enumerate(requests) if depth < wanted[r.request_id]
                    and r.num_computed_tokens + depth - 1 < len(block_tables[r.request_id]) * self.block_size]
            if not live:
                break
            index = torch.as_tensor(live, device=hidden.device)
            hidden, positions = hidden.index_select(0, index), positions.index_select(0, index.to(positions.device)) + 1
            requests, order = [requests[i] for i in live], [order[i] for i in live]
            out, hidden = self._run_chained(requests, ids.index_select(0, index.to(ids.device)), hidden, positions, block_tables, depth)
            ids = self.head.greedy(out)
            columns.append((order, ids))
        values = iter(torch.cat([column for _, column in columns]).tolist())  # every draft read back at once
        drafts: dict[str, list[int]] = {r.request_id: [] for r in first}
        for order, _ in columns:
            for row in order:
                drafts[first[row].request_id].append(next(values))
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

    def _run_kept(self, step: TargetStep, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over each request's kept positions: row j reads the target's hidden state at j and the
        embedding of the token at j+1 (a picture's, inside one)."""
        device = step.hidden.device
        index = torch.as_tensor(np.concatenate([np.arange(f, f + n) for f, n in zip(rows.first_rows, rows.counts)]), device=device)
        next_ids = [t for s, n in zip(rows.scheduled, rows.counts) for t in s.request.all_token_ids[s.start + 1 : s.start + n + 1]]
        shifted = [ScheduledRequest(s.request, s.start + 1, n, []) for s, n in zip(rows.scheduled, rows.counts)]
        embeds = self.head.embed(torch.as_tensor(next_ids, device=device), shifted)
        starts = [s.start for s in rows.scheduled]
        metadata = _metadata(step.slot_mapping.index_select(0, index), step.block_tables.index_select(
            0, torch.as_tensor(rows.batch_rows, device=step.block_tables.device)), rows.counts,
            [start + n for start, n in zip(starts, rows.counts)])
        self.num_head_rows += len(index)
        return self.head.forward(embeds, step.hidden.index_select(0, index),
                                 step.positions.index_select(0, index.to(step.positions.device)), metadata, 0, first=True)

    def _run_chained(self, requests: list, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     block_tables: dict[str, list[int]], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step for each request, one position past the last: the previous draft's embedding and
        the head's own hidden state there."""
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
        self.num_head_rows += len(requests)
        embeds = self.head.embed_drafts(ids)
        return self.head.forward(embeds, hidden, positions, metadata, depth, first=False)


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


class MtpHead:
    """Qwen3.5's MTP head as a DraftHead: the target's final hidden states, embeddings (pictures' too) and LM head."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.model = runner.model

    def target_hidden(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return final_hidden

    def embed(self, token_ids: torch.Tensor, spans: list[ScheduledRequest]) -> torch.Tensor:
        return self.runner._embed(token_ids, spans, missing_ok=True)[0]

    def embed_drafts(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.embed_tokens(token_ids)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                draft_step: int, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        from mmengine.layers.kernel_dispatch import use_fused_kernels

        head = self.model.mtp
        rotary = self.model.language_model.rotary.step(positions, use_kernel=False)
        fused = use_fused_kernels(embeds.device, head.attention_layers()[0].backend.name)
        out = head(embeds.to(hidden.dtype), hidden, rotary, metadata, draft_step, fused)
        return out, out  # chained, the head's own output (after its norm) stands for the target's

    def greedy(self, output: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(output).argmax(dim=-1)

    def attention_layers(self) -> list:
        return self.model.mtp.attention_layers()


class Eagle3DraftHead:
    """An EAGLE-3 head (models/eagle3.py) as a DraftHead. Its input is the target's residual stream before
    three decoder layers, which pre-hooks copy into one persistent buffer (so CUDA-graph replays of the
    decode step fill it too); `fc` fuses them right after the target's forward."""

    def __init__(self, runner, model_dir: str) -> None:
        from mmengine.models.eagle3 import Eagle3Head, aux_layer_ids, has_own_embeddings, load_eagle3_config

        self.runner = runner
        self.model = runner.model
        config = load_eagle3_config(model_dir)
        decoder = self.model.language_model
        hidden = decoder.config.hidden_size
        build = getattr(runner.family, "build_eagle3_head", None)  # a tensor-parallel rank's: split, read shard by shard
        if build is not None:
            self.head = build(config, hidden, has_own_embeddings(model_dir), model_dir, runner.device, runner.dtype)
        else:
            with torch.device(runner.device):
                self.head = Eagle3Head(config, hidden, has_own_embeddings(model_dir)).to(runner.dtype)
            self.head.load(model_dir)
            self.head.eval()
        self.hidden = hidden
        self.layer_ids = aux_layer_ids(config, len(decoder.layers))
        self.aux = torch.zeros((runner.inputs.max_tokens, 3 * hidden), device=runner.device, dtype=runner.dtype)
        for layer in sorted(set(self.layer_ids)):
            decoder.layers[layer].register_forward_pre_hook(self._capture_hook([i for i, l in enumerate(self.layer_ids) if l == layer]))
        self.mrope = self.head.rotary.mrope_section is not None

    def _capture_hook(self, slots: list[int]):
        def capture(module, args) -> None:
            x, residual = args[0], args[1]
            stream = x if residual is None else x + residual
            for slot in slots:
                self.aux[: len(stream), slot * self.hidden : (slot + 1) * self.hidden].copy_(stream)
        return capture

    def target_hidden(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return self.head.fc(self.aux[: len(final_hidden)])

    def embed(self, token_ids: torch.Tensor, spans: list[ScheduledRequest]) -> torch.Tensor:
        table = self.head.embed_tokens
        if table is not None and table.embedding_dim != self.hidden:  # pictures' embeddings would not fit: text only
            return table(token_ids)
        return self.runner._embed(token_ids, spans, missing_ok=True, table=table)[0]

    def embed_drafts(self, token_ids: torch.Tensor) -> torch.Tensor:
        table = self.head.embed_tokens if self.head.embed_tokens is not None else self.model.language_model.embed_tokens
        return table(token_ids)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                draft_step: int, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        from mmengine.layers.kernel_dispatch import use_fused_kernels

        if positions.dim() == 2 and not self.mrope:
            positions = positions[:, 0]  # a plain-RoPE head on an M-RoPE target: the temporal channel
        fused = use_fused_kernels(embeds.device, self.head.midlayer.self_attn.attn.backend.name)
        return self.head(embeds.to(hidden.dtype), hidden, positions, metadata, fused)

    def greedy(self, output: torch.Tensor) -> torch.Tensor:
        return self.head.greedy(output)

    def attention_layers(self) -> list:
        return self.head.attention_layers()
