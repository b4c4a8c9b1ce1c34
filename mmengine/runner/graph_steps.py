"""The steps a CUDA graph capture records, and the static tensors they read and write past the input buffers.

It owns, for one capture: the static output a replay leaves the final hidden states in (rows beyond the batch are
padding), a hybrid model's live slot per decode row (padding rows: the scratch slot) and token columns of its verify
rows (runner/verify_graphs.py), each verify graph's attention metadata (whose host lists a replay refreshes), and the
step closures that capture_all records: a decode step of `size` rows (with its cascade or LoRA variant) and a verify
step of `size` requests of 1 + num_speculative_tokens tokens, both over the persistent input buffers. Released with
the graphs; the runner decides when a step replays (ModelRunner._graph_size_for).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmengine.core.scheduler import ScheduledRequest
from mmengine.layers.attention import AttentionMetadata
from mmengine.layers.gated_delta import RecurrentStep
from mmengine.layers.lora import LoRAContext
from mmengine.runner.cuda_graphs import DecodeGraphs
from mmengine.runner.inputs import InputBuffers
from mmengine.runner.verify_graphs import RecurrentColumns, refresh_host_lists, verify_metadata


class GraphSteps:
    def __init__(self, model: torch.nn.Module, inputs: InputBuffers, attn_backend, lora_context: LoRAContext | None,
                 graphs: DecodeGraphs, *, hidden_size: int, max_model_len: int, num_kv_heads: int,
                 scratch_state_slot: int | None, dtype: torch.dtype, device: torch.device) -> None:
        """`scratch_state_slot`: a hybrid model's scratch slot (None without recurrent states)."""
        self.model, self.inputs, self.attn_backend, self.lora_context = model, inputs, attn_backend, lora_context
        self.max_model_len, self.num_kv_heads, self.device = max_model_len, num_kv_heads, device
        self.query_len = graphs.verify_query_len
        sizes, verify_sizes = graphs.sizes, graphs.verify_sizes
        rows = max(max(sizes), max(verify_sizes, default=0) * self.query_len)
        self.hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.scratch_state_slot = scratch_state_slot
        self.state_slots: torch.Tensor | None = None  # a decode graph's slot per row, rewritten before each replay
        self.verify_columns: RecurrentColumns | None = None  # a hybrid model's verify graphs, by token column
        if scratch_state_slot is not None:
            self.state_slots = torch.full((max(sizes),), scratch_state_slot, dtype=torch.long, device=device)
            if verify_sizes:
                self.verify_columns = RecurrentColumns(max(verify_sizes), self.query_len, scratch_state_slot, device)
        self.verify_metadata: dict[int, AttentionMetadata] = {}  # each verify graph's, for its host lists

    def verify_step(self, size: int) -> Callable[[], None]:
        """A verify step of `size` requests of up to 1 + num_speculative_tokens tokens over the persistent
        buffers (runner/verify_graphs.py), writing the final hidden states into the static output."""
        query_len = self.query_len
        num_tokens = size * query_len
        self.inputs.fill_dummy_decode(size, query_len)
        buffers = self.inputs
        metadata = verify_metadata(
            size, query_len, buffers.slot_mapping.device[:num_tokens], buffers.query_start_loc.device[: size + 1],
            buffers.seq_lens.device[:size], buffers.block_tables.device[:size],
            buffers.window_slot_mapping.device[:num_tokens] if buffers.windowed else None,
            buffers.window_block_tables.device[:size] if buffers.windowed else None,
        )
        if self.scratch_state_slot is not None:
            self.verify_columns.fill_padding(size)
            metadata.recurrent = RecurrentStep([0], [], graph_columns=self.verify_columns.views(size))
        self.verify_metadata[size] = metadata
        input_ids, positions = buffers.input_ids.device[:num_tokens], buffers.positions.device[:num_tokens]
        hidden_out = self.hidden[:num_tokens]
        context, model = self.lora_context, self.model

        def step() -> None:
            if context is not None:
                context.segments = None  # verify graphs have no LoRA variant: a step with adapters runs eager
            hidden_out.copy_(model(model.embed_tokens(input_ids), positions, metadata, input_ids=input_ids))

        return step

    def decode_step(self, size: int, cascade: bool = False, lora: bool = False) -> Callable[[], None]:
        """A decode step of `size` rows over the persistent buffers, writing the final hidden states
        into the static output. Everything the launches depend on is fixed per size: the decode
        attention's split count, a context bound of max_model_len and, for the cascade variant, the
        prefix pass's grids (runner/cascade_plan.py's GraphBounds)."""
        self.inputs.fill_dummy_decode(size)
        splits = None
        if hasattr(self.attn_backend, "choose_num_splits"):
            splits = self.attn_backend.choose_num_splits(size, self.num_kv_heads, self.max_model_len, self.device)
        buffers = self.inputs
        metadata = AttentionMetadata(
            slot_mapping=buffers.slot_mapping.device[:size],
            query_start_loc=buffers.query_start_loc.device[: size + 1],
            seq_lens=buffers.seq_lens.device[:size],
            block_tables=buffers.block_tables.device[:size],
            window_slot_mapping=buffers.window_slot_mapping.device[:size] if buffers.windowed else None,
            window_block_tables=buffers.window_block_tables.device[:size] if buffers.windowed else None,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            query_start_loc_cpu=list(range(size + 1)),
            num_decodes=size,
            max_decode_seq_len=self.max_model_len,
            max_prefill_query_len=0,
            decode_num_splits=splits,
            cascade=self.inputs.cascade_graph_metadata(size, self.inputs.cascade.graph_bounds(size, self.max_model_len))
            if cascade else None,
        )
        if self.scratch_state_slot is not None:
            self.state_slots.fill_(self.scratch_state_slot)
            metadata.recurrent = RecurrentStep(list(range(size + 1)), [], decode_slots=self.state_slots[:size])
        input_ids, positions = buffers.input_ids.device[:size], buffers.positions.device[:size]
        hidden_out = self.hidden[:size]
        context, model = self.lora_context, self.model
        segments = buffers.lora_graph_segments(size) if lora else None

        def step() -> None:
            if context is not None:  # read while the step is recorded (or, on the CPU stand-in, re-run)
                context.segments = segments
            hidden_out.copy_(model(model.embed_tokens(input_ids), positions, metadata, input_ids=input_ids))

        return step

    def set_state_slots(self, scheduled: list[ScheduledRequest], graph_size: int) -> None:
        """Each row's live slot for the decode graph step (padding rows: the scratch slot). Copied from a fresh
        host tensor, which the copy has read when it returns, so the next step may rewrite nothing early."""
        slots = [s.state.slot for s in scheduled] + [self.scratch_state_slot] * (graph_size - len(scheduled))
        self.state_slots[:graph_size].copy_(torch.tensor(slots, dtype=torch.long))

    def prepare_verify(self, step_metadata: AttentionMetadata, scheduled: list[ScheduledRequest], size: int) -> None:
        """Before a verify graph's replay: the step's host lists into the captured metadata and (a hybrid model)
        its token columns into the device buffers."""
        refresh_host_lists(self.verify_metadata[size], step_metadata)
        if self.verify_columns is not None:
            self.verify_columns.fill(scheduled, step_metadata.query_start_loc_cpu, size)
