"""Drafts with a draft head within the step that samples: Qwen3.5's own MTP head (models/qwen3_5_mtp.py) or an
EAGLE-3 head (models/eagle3.py), both one decoder layer that reads the target's hidden states.

Right after a step's tokens are sampled, still on the device and before anything is read back (`ModelRunner.sample`
calls `draft`; a tensor-parallel rank's runner does the same, so the ranks draft as TP 1 does):

1. The head over every position the step computed: row j reads the target's hidden state at j and the
   token after j, which is the next known token or, where the step sampled at j, the sample. This fills the
   head's own K/V for those positions, as the target's forward filled the target's, so the head's context
   follows the request through chunked prefill, prefix hits (a cached block holds the head's K/V too) and
   verify steps. A verify row's sample at draft position i is the token after it whenever the drafts before
   it were accepted, so its kept rows get exactly what a pass over the kept positions alone would; its
   rejected rows write K/V past the kept run, which the chain below and the next step write again before
   anything reads them.
2. Each sampling request's kept run ends at its accepted count, computed on the device (`kept_counts`): that
   row's output gives the first draft (greedy), and each further draft comes from one more head step over
   the previous draft at the next position, fed the head's own hidden state, writing K/V past the run into
   blocks the step loop took before the step (`DraftPlanner.take_draft_blocks`, engine/draft_planner.py). The chain runs
   as long as the step's longest, but a request's row stores only within its own chain length (the drafts it may take
   after the step) and its blocks: what the scheduler keeps for it while the step is in flight. A position past either
   stores nothing, and the drafts from there on are not counted (`DeviceDrafts.counts`).

So a step's tokens, its drafts (num_speculative_tokens a request) and their counts come back in one copy
(launched_step.py). The step loop hands each request a prefix of them once it has booked the step
(spec/head_drafts.py): a chain's first drafts do not depend on how long it runs. The drafts only ever change
how many tokens a step keeps, never which: a verify step samples every position with the target (spec/verify.py).
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
    """What the head needs of the target's step (device views, valid until the next step's inputs)."""

    hidden: torch.Tensor  # [rows, width] the head's input hidden state per row (DraftHead.target_hidden)
    positions: torch.Tensor  # [rows] or [rows, 3] (M-RoPE)
    slot_mapping: torch.Tensor  # [rows]
    block_tables: torch.Tensor  # [requests, max_blocks]
    scheduled: list[ScheduledRequest]  # in packed order (one-token requests first)
    query_start_loc: list[int]
    logits_indices: torch.Tensor  # [sampled rows] the rows whose samples are the step's tokens, in their order
    num_blocks: list[int]  # each request's blocks (with those taken for its chained drafts)
    depth: int  # drafts to chain (the most any sampling request may take after the step)
    input_ids: torch.Tensor  # [rows] the step's tokens (a verify row's drafts: those the device verified)
    seq_lens: torch.Tensor  # [requests] each request's context after the step, on the device
    seq_lens_cpu: list[int]  # their host copies (bounds, for rows moved on the device off the CPU)
    # Rows launched ahead of their request's verify step: each request's start moved on the device by the drafts kept
    # there ([requests], None: none moved), and a host bound on those moves
    shifts: torch.Tensor | None = None
    max_shift: int = 0
    chains: dict[str, int] | None = None  # each sampling request's own chain length (None: `depth` for all)


@dataclass
class DeviceDrafts:
    """A step's drafts, on the device until its tokens are read back with them; a step launched before they are
    read takes its rows' tokens, positions and (hybrid models) states from them (follow_drafts.follow_drafts)."""

    request_ids: list[str]  # the sampling requests, in the order of the rows below
    drafts: torch.Tensor  # [requests, the step's chain length] int64
    counts: torch.Tensor  # [requests] int64: the leading drafts computed within the request's blocks
    accepted: torch.Tensor  # [requests] int64: the drafts each request's row kept (0 without drafts)
    first_samples: list[int]  # each request's first sample among the step's tokens (its kept run's last: + accepted)
    num_verified: list[int]  # the drafts each request's row verified (the most it can have kept)
    # hybrid models: each request's state after its row's first 1, 2, ... tokens (its draft slots, then its live slot)
    state_sources: list[list[int]] | None = None


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
        """Each row's most likely next token, in the target's vocabulary (on the device)."""

    def attention_layers(self) -> list:
        """The head's attention layers, whose K/V the KV cache keeps after the target's."""


def kept_counts(tokens: torch.Tensor, sampled: list[ScheduledRequest], drafts: torch.Tensor | None = None) -> torch.Tensor:
    """[sampling requests] the positions each sampling request keeps from its step, on the device (no host sync):
    a verify row keeps its last token and the drafts its samples accept (spec/verify.py's accepted_prefix), a
    decode its one token, a prompt's last chunk all of it. `tokens` are the step's samples, one per entry of
    `sampled` (a verify row's request repeated once per position); `drafts` [requests, most drafts] the drafts
    each row verified, padded with -1 (None: the rows' own draft_token_ids)."""
    rows = _sampling_rows(sampled)
    device = tokens.device
    num_drafts = np.array([len(s.draft_token_ids) for s, _ in rows], dtype=np.int64)
    known = torch.as_tensor(np.array([s.num_new_tokens for s, _ in rows], dtype=np.int64) - num_drafts).to(device, non_blocking=True)
    width = int(num_drafts.max(initial=0))
    if width == 0:
        return known
    index = np.zeros((len(rows), width), dtype=np.int64)
    for r, (_, first) in enumerate(rows):
        index[r] = np.minimum(first + np.arange(width), len(sampled) - 1)
    if drafts is None:
        padded = np.full((len(rows), width), -1, dtype=np.int64)  # -1: no token equals it, the run stops there
        for r, (s, _) in enumerate(rows):
            padded[r, : num_drafts[r]] = s.draft_token_ids
        drafts = torch.as_tensor(padded).to(device, non_blocking=True)
    index_dev = torch.as_tensor(index).to(device, non_blocking=True)
    accepted = (tokens.index_select(0, index_dev.flatten()).view(len(rows), width) == drafts).long().cumprod(dim=1).sum(dim=1)
    return known + accepted


def _state_sources(scheduled: list[ScheduledRequest]) -> list[list[int]] | None:
    """A hybrid model's: each request's slots holding its state after its row's first 1, 2, ... tokens."""
    if not scheduled or scheduled[0].state is None:
        return None
    return [[slot for _, slot in s.state.draft_saves] + [s.state.slot] for s in scheduled]


def _sampling_rows(sampled: list[ScheduledRequest]) -> list[tuple[ScheduledRequest, int]]:
    """Each sampling request once, with the index of its first entry in `sampled`."""
    rows: list[tuple[ScheduledRequest, int]] = []
    for index, s in enumerate(sampled):
        if not rows or rows[-1][0] is not s:
            rows.append((s, index))
    return rows


class HeadDrafter:
    def __init__(self, head: DraftHead, block_size: int, num_speculative_tokens: int) -> None:
        self.head = head
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.step: TargetStep | None = None
        self.num_head_rows = 0  # rows the head computed, the steps' positions and chained drafts together

    def remember(self, final_hidden: torch.Tensor, inputs, block_tables: dict[str, list[int]],
                 depths: dict[str, int] | None = None, shifts: torch.Tensor | None = None, max_shift: int = 0) -> None:
        """`depths`: the drafts each sampling request may take after the step, at most (None: all k). `shifts`:
        rows launched ahead, moved on the device (TargetStep)."""
        metadata = inputs.metadata
        k = self.num_speculative_tokens
        depth = k if depths is None else min(k, max((depths.get(s.request.request_id, k) for s in inputs.sampled), default=0))
        self.step = TargetStep(self.head.target_hidden(final_hidden), inputs.positions, metadata.slot_mapping,
                               metadata.block_tables, inputs.scheduled, metadata.query_start_loc_cpu, inputs.logits_indices,
                               [len(block_tables[s.request.request_id]) for s in inputs.scheduled], depth, inputs.input_ids,
                               metadata.seq_lens, list(metadata.seq_lens_cpu), shifts, max_shift, depths)

    def forget(self) -> None:
        self.step = None

    @torch.inference_mode()
    def draft(self, tokens: torch.Tensor | None, sampled: list[ScheduledRequest]) -> DeviceDrafts | None:
        """The head's pass over the remembered step and every sampling request's chain of drafts (module
        docstring), queued on the device. `tokens`: the step's samples, one per entry of `sampled` (a step that
        samples nothing, a prompt's chunk, still gets the pass: its K/V)."""
        step, self.step = self.step, None
        if step is None:
            return None
        out, chain = self._run_step(step, tokens)
        if not sampled:
            return None
        rows = _sampling_rows(sampled)
        batch_row = {id(s): r for r, s in enumerate(step.scheduled)}
        batch_rows = [batch_row[id(s)] for s, _ in rows]
        device = out.device
        batch_index = torch.as_tensor(batch_rows).to(device, non_blocking=True)
        firsts = torch.as_tensor([step.query_start_loc[r] for r in batch_rows]).to(device, non_blocking=True)
        known = [s.num_new_tokens - len(s.draft_token_ids) for s, _ in rows]
        kept = kept_counts(tokens, sampled, self._verified_drafts(step, rows, batch_rows, known))  # [requests]
        last = firsts + kept - 1  # each request's last kept row
        out, hidden = out.index_select(0, last), chain.index_select(0, last)
        positions = step.positions.index_select(0, last.to(step.positions.device))
        computed = torch.as_tensor([s.start for s, _ in rows]).to(device, non_blocking=True) + kept  # after booking
        if step.shifts is not None:
            computed = computed + step.shifts.index_select(0, batch_index)
        num_blocks = torch.as_tensor([step.num_blocks[r] for r in batch_rows]).to(device, non_blocking=True)
        tables = step.block_tables.index_select(0, batch_index.to(step.block_tables.device))
        # a host-side bound on each chained row's context (the decode attention reads no further)
        bounds = [s.start + s.num_new_tokens + step.max_shift for s, _ in rows]
        found = DeviceDrafts([s.request.request_id for s, _ in rows], kept.new_zeros((len(rows), 0)), torch.zeros_like(kept),
                             kept - torch.as_tensor(known).to(device, non_blocking=True), [first for _, first in rows],
                             [len(s.draft_token_ids) for s, _ in rows], _state_sources([s for s, _ in rows]))
        if step.depth == 0:  # no request takes drafts after this step
            return found
        ids = self.head.greedy(out)
        columns, counts = [ids], torch.ones_like(kept)
        chains = torch.as_tensor([step.depth if step.chains is None else step.chains.get(s.request.request_id, step.depth)
                                  for s, _ in rows]).to(device, non_blocking=True)
        for depth in range(1, step.depth):
            positions = positions + 1
            contexts = computed + depth  # the row's position + 1
            stored = ((contexts - 1) // self.block_size < num_blocks) & (depth < chains)
            counts = counts + stored.long()
            out, hidden = self._run_chained(ids, hidden, positions, tables, contexts, stored, [b + depth for b in bounds], depth)
            ids = self.head.greedy(out)
            columns.append(ids)
        found.drafts, found.counts = torch.stack(columns, dim=1), counts
        return found

    @staticmethod
    def _verified_drafts(step: TargetStep, rows: list, batch_rows: list[int], known: list[int]) -> torch.Tensor | None:
        """[requests, most drafts] the drafts each sampling row verified as the device holds them (padded with -1),
        None when no row verifies any."""
        num_drafts = [len(s.draft_token_ids) for s, _ in rows]
        width = max(num_drafts, default=0)
        if width == 0:
            return None
        index = np.zeros((len(rows), width), dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=bool)
        for r, (batch_row, n) in enumerate(zip(batch_rows, num_drafts)):
            first = step.query_start_loc[batch_row] + known[r]
            index[r, :n] = np.arange(first, first + n)
            mask[r, :n] = True
        device = step.input_ids.device
        ids = step.input_ids.index_select(0, torch.as_tensor(index.reshape(-1)).to(device, non_blocking=True)).view(len(rows), width)
        return torch.where(torch.as_tensor(mask).to(device, non_blocking=True), ids, -1)

    def _run_step(self, step: TargetStep, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over every row of the step: row j reads the target's hidden state at j and the embedding of
        the token after j (a picture's, inside one; the step's sample where it sampled at j)."""
        scheduled = step.scheduled
        num_rows = step.query_start_loc[len(scheduled)]
        device = step.hidden.device
        next_ids = np.zeros(num_rows, dtype=np.int64)
        for s, first in zip(scheduled, step.query_start_loc):
            known = s.request.all_token_ids[s.start + 1 : s.end + 1]  # (a sampled row's own token is not known yet)
            next_ids[first : first + len(known)] = known
        next_ids = torch.as_tensor(next_ids).to(device, non_blocking=True)
        if tokens is not None:
            next_ids.index_copy_(0, step.logits_indices, tokens)
        shifted = [ScheduledRequest(s.request, s.start + 1, s.num_new_tokens, []) for s in scheduled]
        embeds = self.head.embed(next_ids, shifted)
        lengths = [s.num_new_tokens for s in scheduled]
        metadata = _metadata(step.slot_mapping[:num_rows], step.block_tables[: len(scheduled)], lengths,
                             step.seq_lens_cpu[: len(scheduled)], step.seq_lens[: len(scheduled)])
        self.num_head_rows += num_rows
        return self.head.forward(embeds, step.hidden[:num_rows], step.positions[:num_rows], metadata, 0, first=True)

    def _run_chained(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                     contexts: torch.Tensor, stored: torch.Tensor, bounds: list[int], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step for each sampling request, one position past the last: the previous draft's embedding
        and the head's own hidden state there. A position past the request's blocks stores nothing (slot -1)."""
        bs = self.block_size
        width = tables.shape[1]
        position = contexts - 1
        column = (position // bs).clamp(max=width - 1)
        slots = tables.gather(1, column[:, None]).squeeze(1).long() * bs + position % bs
        slots = torch.where(stored, slots, -1)
        seq_lens = contexts.clamp(max=width * bs)
        metadata = _metadata(slots, tables, [1] * len(bounds), [min(b, width * bs) for b in bounds], seq_lens)
        self.num_head_rows += len(bounds)
        return self.head.forward(self.head.embed_drafts(ids), hidden, positions, metadata, depth, first=False)


def _metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
              device_seq_lens: torch.Tensor | None = None) -> AttentionMetadata:
    """A batch of requests, one-row ones first, each its query_lens rows ending at position seq_lens - 1.
    `device_seq_lens`: the contexts on the device, where the host knows only bounds of them (`seq_lens`: the
    decode attention reads the device's and the bound; the reference's prefill reads the host's, exact on the CPU)."""
    device = slot_mapping.device
    query_start_loc = [0, *np.cumsum(query_lens).tolist()]
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    if device_seq_lens is None:
        device_seq_lens = torch.as_tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.as_tensor(query_start_loc, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=device_seq_lens.to(torch.int32),
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
