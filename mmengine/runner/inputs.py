"""Persistent step inputs: host buffers (pinned on CUDA) that each step fills, copied without
blocking into device buffers that never move.

Fixed device addresses let a CUDA graph captured over these buffers replay on whatever the
latest step wrote, and filling only the host side keeps the step free of host synchronisation:
nothing is allocated per step and nothing is read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mmengine.layers.attention import AttentionMetadata, decode_prefix_length
from mmengine.layers.lora import LoRASegments
from mmengine.layers.cascade import (
    DEVICE_ARRAYS,
    CascadeGroup,
    CascadeLayout,
    CascadeMetadata,
    count_tiles,
    host_lists,
    launch_bounds,
    layout_counts,
    layout_cascade,
)
from mmengine.runner.cascade_plan import CascadePolicy, GraphBounds
from mmengine.core.request import PLACEHOLDER_TOKEN
from mmengine.sample.sampler import SamplingTensors, sampling_rows
from mmengine.core.scheduler import ScheduledRequest

PAD_SLOT = -1  # a padded row's K/V is never stored
PAD_SEQ_LEN = 1  # a padded row attends to one (stale, harmless) key: no empty softmax anywhere


class HostDeviceBuffer:
    """One host tensor and its device twin of the same shape; steps write a prefix of rows."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.host.numpy()
        self.device = self.host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def upload(self, rows: int) -> torch.Tensor:
        """Copies the first `rows` rows to the device (asynchronously from pinned memory) and returns
        the device view."""
        if self.device is not self.host:
            self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        return self.device[:rows]


@dataclass
class StepInputs:
    """One step's packed batch: device views of the persistent buffers plus host-side facts."""

    input_ids: torch.Tensor  # [padded_tokens]
    positions: torch.Tensor  # [padded_tokens], or [padded_tokens, 3] with M-RoPE
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states whose logits are sampled
    sampling: SamplingTensors | None  # None when every sampled row is greedy
    scheduled: list[ScheduledRequest]  # in the order of the packed batch (decodes first)
    sampled: list[ScheduledRequest]
    num_tokens: int  # real tokens; the batch may be padded beyond them to a CUDA-graph size
    graph_size: int | None  # the CUDA graph this step replays, or None (eager)
    graph_query_len: int = 1  # tokens a request the graph holds: 1 (a decode graph) or a verify graph's
    cascade_groups: list[CascadeGroup] = field(default_factory=list)  # shared-prefix groups
    graph_cascade: bool = False  # the graph replayed is the bucket's cascade variant
    graph_lora: bool = False  # the graph replayed is the bucket's LoRA variant (slots in the per-row buffer)
    # Async scheduling: token rows whose id the previous step sampled and the device still holds,
    # with the index of each among that step's sampled tokens (device tensors; None when there are none).
    deferred_rows: torch.Tensor | None = None
    deferred_sources: torch.Tensor | None = None


@dataclass
class _PackedBatch:
    """One step's requests as host arrays, in packed (decodes first) order."""

    query_lens: np.ndarray  # [R] new tokens per request
    starts: np.ndarray  # [R] the first new token's position
    hit_ends: np.ndarray  # [R] tokens of a prefix hit: their K/V is cached, never written again
    row_blocks: list[list[int]] = field(default_factory=list)
    deferred: list[tuple[int, int]] = field(default_factory=list)  # (token row, index among the previous step's sampled tokens)
    sampled_rows: list[int] = field(default_factory=list)
    num_tokens: int = 0
    query_start_loc: np.ndarray | None = None  # [padded R + 1], once the token buffers are filled

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def seq_lens(self) -> np.ndarray:
        return self.starts + self.query_lens


class InputBuffers:
    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        position_channels: int = 1,
        cascade: CascadePolicy | None = None,
        lora: bool = False,
        windowed: bool = False,
        max_sampled_rows: int | None = None,
    ) -> None:
        """`windowed`: the sliding-window layers keep their blocks in a pool of their own, with its own
        block tables and slots. `max_sampled_rows`: logits rows a step may sample (None: one per request;
        speculative decoding samples each draft's position too)."""
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.max_reqs = max_reqs

        def buf(*shape: int, dtype: torch.dtype) -> HostDeviceBuffer:
            return HostDeviceBuffer(shape, dtype, device)

        self.input_ids = buf(max_tokens, dtype=torch.int64)
        self.position_channels = position_channels
        self.positions = buf(max_tokens, dtype=torch.int64) if position_channels == 1 else buf(max_tokens, position_channels, dtype=torch.int64)
        self.slot_mapping = buf(max_tokens, dtype=torch.int64)
        self.query_start_loc = buf(max_reqs + 1, dtype=torch.int32)
        self.seq_lens = buf(max_reqs, dtype=torch.int32)
        self.block_tables = buf(max_reqs, max_blocks_per_req, dtype=torch.int32)
        self.windowed = windowed
        if windowed:
            self.window_slot_mapping = buf(max_tokens, dtype=torch.int64)
            self.window_block_tables = buf(max_reqs, max_blocks_per_req, dtype=torch.int32)
        max_rows = max_sampled_rows or max_reqs
        self.logits_indices = buf(max_rows, dtype=torch.int64)
        self.greedy = buf(max_rows, dtype=torch.bool)
        self.temperature = buf(max_rows, dtype=torch.float32)
        self.top_k = buf(max_rows, dtype=torch.int64)
        self.top_p = buf(max_rows, dtype=torch.float32)
        self.deferred_rows = buf(max_reqs, dtype=torch.int64)
        self.deferred_sources = buf(max_reqs, dtype=torch.int64)
        self.cascade = cascade if cascade is not None and cascade.mode != "off" else None
        if self.cascade is not None:
            self.cascade_buffers = CascadeBuffers(max_tokens, max_reqs, max_blocks_per_req, buf)
        # Batch sizes whose decode graph has a cascade variant, and what that variant holds (set at capture).
        self.cascade_graph_bounds: dict[int, GraphBounds] = {}
        # LoRA in decode graphs: one fixed segment per row, each row's adapter slot (-1: none) rewritten every step.
        self.lora_slots = buf(max_reqs, dtype=torch.int32) if lora else None
        if lora:
            self._lora_row_starts = torch.arange(max_reqs, dtype=torch.int32, device=device)
            self._lora_row_lens = torch.ones(max_reqs, dtype=torch.int32, device=device)
        # Recorded after each step's uploads: the host side may be rewritten once they are done.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def prepare(
        self,
        scheduled: list[ScheduledRequest],
        block_tables: dict[str, list[int]],
        graph_size: int | None = None,
        previous_rows: dict[str, int] | None = None,
        lora_slots: dict[str, int] | None = None,
        window_tables: dict[str, list[int]] | None = None,
        graph_query_len: int = 1,
        moved_on_device: bool = False,
    ) -> StepInputs:
        """Packs the scheduled requests (decodes first, each with num_new_tokens > 0) into the
        buffers. With a graph size, the batch is padded to it with rows that store nothing.
        `previous_rows` (async scheduling) maps a request whose last token is a placeholder to
        that token's index among the previous step's sampled tokens. `lora_slots` maps requests that
        run an adapter to its slot; in a graph step they go into the per-row slot buffer (and the
        step takes no cascade variant: a graph has either). `window_tables`: the sliding-window pool's
        block tables (when the buffers are windowed). `moved_on_device`: rows launched ahead of a draft head's
        step are moved on the device afterwards (runner/follow_drafts.py). `graph_query_len` > 1: the graph is a verify graph of
        graph_size requests of up to that many tokens (it has neither a LoRA nor a cascade variant: a
        step with adapters runs eager, one with shared prefixes runs without cascade attention)."""
        if graph_query_len > 1 and lora_slots:
            graph_size = None
        if graph_size is None:
            graph_query_len = 1
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's copies have read the host side
        scheduled = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        assert (window_tables is not None) == self.windowed, "a windowed step needs its window tables, and only it"
        batch = self._pack_requests(scheduled, block_tables, previous_rows, window_tables)
        graph_lora = bool(lora_slots) and graph_size is not None
        # (rows moved on the device after this, moved_on_device: their lengths are not the host's to group)
        plan_cascade = self.cascade is not None and not graph_lora and graph_query_len == 1 and not moved_on_device
        groups, bounds, graph_size = self._plan_cascade(batch, graph_size) if plan_cascade else ([], None, graph_size)
        padded_reqs = graph_size or batch.num_reqs
        # a verify graph's tokens past the padding requests' one each belong to no request: they store nothing
        padded_tokens = graph_size * graph_query_len if graph_query_len > 1 else batch.num_tokens + (padded_reqs - batch.num_reqs)
        assert padded_tokens <= self.max_tokens and padded_reqs <= self.max_reqs, (padded_tokens, padded_reqs)
        token_starts = self._fill_token_buffers(scheduled, batch, padded_tokens, padded_reqs)
        # one logits row per sampling request, at its last token; a verify step's also at each draft before it
        sampled = [scheduled[i] for i in batch.sampled_rows for _ in range(1 + len(scheduled[i].draft_token_ids))]
        last_rows = (token_starts + batch.query_lens - 1)[batch.sampled_rows]
        if len(sampled) == len(batch.sampled_rows):
            self.logits_indices.np[: len(sampled)] = last_rows
        else:
            self.logits_indices.np[: len(sampled)] = [row - len(scheduled[i].draft_token_ids) + j
                                                      for i, row in zip(batch.sampled_rows, last_rows.tolist())
                                                      for j in range(1 + len(scheduled[i].draft_token_ids))]
        sampling = self._sampling_tensors(sampled)
        metadata = self._attention_metadata(batch, padded_tokens, padded_reqs)
        if groups:
            metadata.cascade = self._cascade_metadata(groups, batch.query_lens, batch.seq_lens, bounds, padded_reqs)
        if graph_lora:
            self._upload_lora_slots(scheduled, lora_slots, padded_reqs)
        deferred_rows, deferred_sources = self._upload_deferred(batch.deferred)
        inputs = StepInputs(
            input_ids=self.input_ids.upload(padded_tokens),
            positions=self.positions.upload(padded_tokens),
            metadata=metadata,
            logits_indices=self.logits_indices.upload(len(sampled)),
            sampling=sampling,
            scheduled=scheduled,
            sampled=sampled,
            num_tokens=batch.num_tokens,
            graph_size=graph_size,
            graph_query_len=graph_query_len,
            cascade_groups=groups,
            graph_cascade=bool(groups) and graph_size is not None,
            graph_lora=graph_lora,
            deferred_rows=deferred_rows,
            deferred_sources=deferred_sources,
        )
        if self._uploaded is not None:
            self._uploaded.record()
        return inputs

    def _pack_requests(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]],
                       previous_rows: dict[str, int] | None, window_tables: dict[str, list[int]] | None) -> _PackedBatch:
        """One pass over the batch, the per-request host work: token ids and block tables into the
        buffers, each request's lengths into arrays."""
        num_reqs = len(scheduled)
        batch = _PackedBatch(np.empty(num_reqs, dtype=np.int64), np.empty(num_reqs, dtype=np.int64),
                             np.empty(num_reqs, dtype=np.int64))
        table, ids = self.block_tables.np, self.input_ids.np
        for row, s in enumerate(scheduled):
            request, start, length = s.request, s.start, s.num_new_tokens
            batch.query_lens[row], batch.starts[row], batch.hit_ends[row] = length, start, request.num_prefix_hit_tokens
            blocks = block_tables[request.request_id]
            batch.row_blocks.append(blocks)
            table[row, : len(blocks)] = blocks
            if window_tables is not None:
                window_blocks = window_tables[request.request_id]
                self.window_block_tables.np[row, : len(window_blocks)] = window_blocks
            if length == 1:
                token = request.all_token_ids[start]
                if token == PLACEHOLDER_TOKEN:
                    batch.deferred.append((batch.num_tokens, previous_rows[request.request_id]))
                    token = 0
                ids[batch.num_tokens] = token
            else:
                known = length - len(s.draft_token_ids)
                ids[batch.num_tokens : batch.num_tokens + known] = request.all_token_ids[start : start + known]
                ids[batch.num_tokens + known : batch.num_tokens + length] = s.draft_token_ids
                if request.all_token_ids[start + known - 1] == PLACEHOLDER_TOKEN:
                    # only a verify row launched ahead of a draft head's step, whose token and drafts (placeholders
                    # here) the runner takes on the device (follow_drafts.follow_drafts)
                    assert known == 1, request
                    batch.deferred.append((batch.num_tokens, previous_rows[request.request_id]))
            batch.num_tokens += length
            if s.samples:
                batch.sampled_rows.append(row)
        return batch

    def _plan_cascade(self, batch: _PackedBatch, graph_size: int | None) -> tuple[list[CascadeGroup], GraphBounds | None, int | None]:
        """The step's prefix groups, and the graph it may still run in: one whose cascade bounds hold
        the groups, else none (more groups than the cascade graph holds: the step runs eagerly)."""
        graph_tiles, bounds = None, None
        if graph_size is not None:
            bounds = self.cascade_graph_bounds.get(graph_size)
            graph_tiles = bounds.max_tiles if bounds else 0
        groups = self.cascade.plan(batch.row_blocks, batch.query_lens.tolist(), batch.seq_lens.tolist(), graph_tiles=graph_tiles)
        if groups and graph_size is not None and count_tiles(groups, batch.query_lens, self.cascade.tokens_per_tile) > (graph_tiles or 0):
            graph_size = bounds = None
        return groups, bounds, graph_size

    def _fill_token_buffers(self, scheduled: list[ScheduledRequest], batch: _PackedBatch, padded_tokens: int,
                            padded_reqs: int) -> np.ndarray:
        """Positions, slots, query offsets and context lengths of every token and request, padded;
        returns each request's first token row."""
        num_tokens, num_reqs, query_lens = batch.num_tokens, batch.num_reqs, batch.query_lens
        req_of_token = np.repeat(np.arange(num_reqs), query_lens)
        token_starts = np.cumsum(query_lens) - query_lens
        positions = np.arange(num_tokens) - token_starts[req_of_token] + batch.starts[req_of_token]
        bs = self.block_size
        # A last token recomputed after a full prefix hit sits in a shared cached block
        # that already holds its K/V: it is attended to, never written again (slot -1).
        cached = positions < batch.hit_ends[req_of_token]
        for table, slot_mapping in self._slot_buffers():
            slots = table.np[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
            slots[cached] = PAD_SLOT
            slot_mapping.np[:num_tokens] = slots
            slot_mapping.np[num_tokens:padded_tokens] = PAD_SLOT
        self.input_ids.np[num_tokens:padded_tokens] = 0
        if self.position_channels == 1:
            self.positions.np[:num_tokens] = positions
        else:
            self._fill_mrope_positions(scheduled, positions, token_starts)
        self.positions.np[num_tokens:padded_tokens] = 0
        batch.query_start_loc = np.concatenate(([0], np.cumsum(query_lens), num_tokens + np.arange(1, padded_reqs - num_reqs + 1)))
        self.query_start_loc.np[: padded_reqs + 1] = batch.query_start_loc
        self.seq_lens.np[:num_reqs] = batch.seq_lens
        self.seq_lens.np[num_reqs:padded_reqs] = PAD_SEQ_LEN
        return token_starts

    def _slot_buffers(self) -> list[tuple[HostDeviceBuffer, HostDeviceBuffer]]:
        """(block tables, slot mapping) of each pool."""
        pools = [(self.block_tables, self.slot_mapping)]
        if self.windowed:
            pools.append((self.window_block_tables, self.window_slot_mapping))
        return pools

    def _attention_metadata(self, batch: _PackedBatch, padded_tokens: int, padded_reqs: int) -> AttentionMetadata:
        padding = padded_reqs - batch.num_reqs
        query_lens_list = batch.query_lens.tolist() + [1] * padding
        seq_lens_list = batch.seq_lens.tolist() + [PAD_SEQ_LEN] * padding
        num_decodes = decode_prefix_length(query_lens_list)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.upload(padded_tokens),
            query_start_loc=self.query_start_loc.upload(padded_reqs + 1),
            seq_lens=self.seq_lens.upload(padded_reqs),
            block_tables=self.block_tables.upload(padded_reqs),
            window_slot_mapping=self.window_slot_mapping.upload(padded_tokens) if self.windowed else None,
            window_block_tables=self.window_block_tables.upload(padded_reqs) if self.windowed else None,
            query_lens_cpu=query_lens_list,
            seq_lens_cpu=seq_lens_list,
            query_start_loc_cpu=batch.query_start_loc.tolist(),
            num_decodes=num_decodes,
            max_decode_seq_len=max(seq_lens_list[:num_decodes], default=0),
            max_prefill_query_len=max(query_lens_list[num_decodes:], default=0),
            cascade=None,
        )

    def _upload_lora_slots(self, scheduled: list[ScheduledRequest], lora_slots: dict[str, int], padded_reqs: int) -> None:
        slots = self.lora_slots.np
        slots[:padded_reqs] = -1
        for row, s in enumerate(scheduled):
            slots[row] = lora_slots.get(s.request.request_id, -1)
        self.lora_slots.upload(padded_reqs)

    def _upload_deferred(self, deferred: list[tuple[int, int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(token rows, indices among the previous step's sampled tokens) of placeholder tokens, on the device."""
        if not deferred:
            return None, None
        rows, sources = zip(*deferred)
        self.deferred_rows.np[: len(rows)] = rows
        self.deferred_sources.np[: len(rows)] = sources
        return self.deferred_rows.upload(len(rows)), self.deferred_sources.upload(len(rows))

    def _cascade_metadata(self, groups: list[CascadeGroup], query_lens: np.ndarray, seq_lens: np.ndarray,
                          bounds: GraphBounds | None, padded_reqs: int) -> CascadeMetadata:
        """Lays the groups out into the cascade buffers; in a cascade graph (bounds given), within its bounds."""
        policy = self.cascade
        num_tiles = count_tiles(groups, query_lens, policy.tokens_per_tile)
        longest = max(g.num_prefix_blocks for g in groups) * self.block_size
        splits = policy.prefix_splits(num_tiles, longest, bounds)
        layout = layout_cascade(groups, query_lens, seq_lens, self.block_tables.np, self.block_size, policy.tokens_per_tile, splits)
        return self.cascade_buffers.fill(layout, padded_reqs if bounds is not None else None)

    def cascade_graph_metadata(self, batch_size: int, bounds: GraphBounds) -> CascadeMetadata:
        """The cascade metadata a cascade decode graph of batch_size rows is captured with: the
        persistent buffers, and grids sized for its bounds (a dummy layout with no work is written)."""
        self.cascade_graph_bounds[batch_size] = bounds
        return self.cascade_buffers.graph_view(batch_size, bounds, self.cascade.tokens_per_tile)

    def lora_graph_segments(self, batch_size: int) -> LoRASegments:
        """The segments a LoRA decode graph of batch_size rows is captured with: row i is segment i,
        on the slot the per-row buffer holds when the graph is replayed."""
        return LoRASegments(self._lora_row_starts[:batch_size], self._lora_row_lens[:batch_size],
                            self.lora_slots.device[:batch_size], max_len=1)

    def _fill_mrope_positions(self, scheduled: list[ScheduledRequest], positions: np.ndarray, token_starts: np.ndarray) -> None:
        """M-RoPE: every channel at the token index, except for requests with images: their prompt
        tokens take the family's precomputed table and later tokens are shifted by its delta."""
        out = self.positions.np
        out[: len(positions)] = positions[:, None]
        for row, s in enumerate(scheduled):
            mrope = s.request.mrope_positions
            if mrope is None:
                continue
            first, start, end = int(token_starts[row]), s.start, s.start + s.num_new_tokens
            num_prompt = len(mrope.table)
            if start < num_prompt:
                out[first : first + min(end, num_prompt) - start] = mrope.table[start : min(end, num_prompt)]
            if end > num_prompt:
                out[first + max(start, num_prompt) - start : first + end - start] += mrope.delta

    def _sampling_tensors(self, sampled: list[ScheduledRequest]) -> SamplingTensors | None:
        params = [s.request.sampling_params for s in sampled]
        if all(p.greedy for p in params):
            return None
        n = len(params)
        columns = (self.greedy, self.temperature, self.top_k, self.top_p)
        for column, values in zip(columns, sampling_rows(params, self.vocab_size)):
            column.np[:n] = values
        return SamplingTensors(*(column.upload(n) for column in columns))

    def fill_dummy_decode(self, batch_size: int, query_len: int = 1) -> None:
        """Writes a valid all-padding batch of batch_size requests of query_len tokens each (for capture
        and warm-up runs): a decode batch, or a verify graph's."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        num_tokens = batch_size * query_len
        self.input_ids.np[:num_tokens] = 0
        self.positions.np[:num_tokens] = 0
        self.query_start_loc.np[: batch_size + 1] = np.arange(batch_size + 1) * query_len
        self.seq_lens.np[:batch_size] = max(PAD_SEQ_LEN, query_len)
        for table, slot_mapping in self._slot_buffers():
            slot_mapping.np[:num_tokens] = PAD_SLOT
            table.np[:batch_size] = 0
            table.upload(batch_size)
            slot_mapping.upload(num_tokens)
        if self.lora_slots is not None:
            self.lora_slots.np[:batch_size] = -1
            self.lora_slots.upload(batch_size)
        for buffer in (self.input_ids, self.positions):
            buffer.upload(num_tokens)
        self.seq_lens.upload(batch_size)
        self.query_start_loc.upload(batch_size + 1)
        if self._uploaded is not None:
            self._uploaded.record()


class CascadeBuffers:
    """Persistent buffers of a step's cascade layout (layers/cascade.py)."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, buf) -> None:
        self.token_indices = buf(max_tokens, dtype=torch.int32)
        self.token_positions = buf(max_tokens, dtype=torch.int32)
        self.group_starts = buf(max_reqs + 1, dtype=torch.int32)
        self.prefix_lens = buf(max_reqs, dtype=torch.int32)
        self.group_leaders = buf(max_reqs, dtype=torch.int32)
        self.suffix_seq_lens = buf(max_reqs, dtype=torch.int32)
        self.suffix_block_tables = buf(max_reqs, max_blocks_per_req, dtype=torch.int32)
        self.tile_groups = buf(max_tokens, dtype=torch.int32)
        self.tile_starts = buf(max_tokens, dtype=torch.int32)
        self.counts = buf(3, dtype=torch.int32)

    def fill(self, layout: CascadeLayout, graph_size: int | None = None) -> CascadeMetadata:
        """Writes the layout; for a cascade graph of graph_size rows, the padding rows' suffixes too
        (one harmless key each, as in the plain graph)."""
        views = {}
        for name in DEVICE_ARRAYS:
            values: np.ndarray = getattr(layout, name)
            buffer: HostDeviceBuffer = getattr(self, name)
            rows = len(values)
            buffer.np[:rows] = values
            if name == "suffix_seq_lens" and graph_size is not None:
                buffer.np[rows:graph_size] = PAD_SEQ_LEN
                views[name] = buffer.upload(graph_size)[:rows]
            else:
                views[name] = buffer.upload(rows)
        self.counts.np[:] = layout_counts(layout)
        return CascadeMetadata(**views, counts=self.counts.upload(3), **host_lists(layout), **launch_bounds(layout))

    def graph_view(self, batch_size: int, bounds: GraphBounds, tile_tokens: int) -> CascadeMetadata:
        self.suffix_seq_lens.np[:batch_size] = PAD_SEQ_LEN
        self.suffix_block_tables.np[:batch_size] = 0
        self.counts.np[:] = (0, 1, 0)
        for buffer in (self.suffix_seq_lens, self.suffix_block_tables):
            buffer.upload(batch_size)
        views = {name: getattr(self, name).device for name in DEVICE_ARRAYS}
        views["suffix_seq_lens"] = self.suffix_seq_lens.device[:batch_size]
        views["suffix_block_tables"] = self.suffix_block_tables.device[:batch_size]
        return CascadeMetadata(
            **views, counts=self.counts.upload(3),
            token_indices_cpu=[], token_positions_cpu=[], group_starts_cpu=[0], prefix_lens_cpu=[], group_leaders_cpu=[],
            suffix_seq_lens_cpu=[PAD_SEQ_LEN] * batch_size, tile_tokens=tile_tokens,
            max_work=bounds.max_work, max_tokens=batch_size, max_splits=bounds.max_splits,
        )
