"""A step launched before the draft head's step in flight is read (async scheduling with a draft head): its rows
for that step's requests are moved to where each request's kept run ended, on the device.

The scheduler booked each of those requests as if its verify row kept only its last token (the least it keeps), so
a row of the step launched after it starts at that position, with a placeholder token and placeholder drafts. The
step in flight holds, on the device, each request's accepted count `a`, its samples and the head's drafts
(head_drafter.DeviceDrafts). Before the forward, for each such row (1 + d tokens, d drafts):

- token 0 is the sample after the kept drafts (samples[first + a]), tokens 1..d the head's drafts;
- every position moves on by `a` (all three M-RoPE channels: these are text positions), and so do the context
  length and each token's KV slot (read from the block table, whose blocks the step loop took for the furthest
  case);
- a hybrid model's live state becomes the state after the kept run (the draft slot of its last kept position, or
  the live slot itself when every draft was kept), as the host restores it after booking a verify step. (Its
  checkpoints are booked once the step is read, and copied at the start of the next: Scheduler.resolve_runs.)

The shapes stay those the host planned (query offsets, token counts), so verify graphs replay as planned. Host-side
lengths (read by the reference attention only) are exact on the CPU and upper bounds elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch

from mmengine.core.request import PLACEHOLDER_TOKEN
from mmengine.layers.gated_delta import GatedDeltaStates
from mmengine.runner.head_drafter import DeviceDrafts


def follow_drafts(inputs, tokens: torch.Tensor, drafts: DeviceDrafts, block_size: int,
                  states: list[GatedDeltaStates], exact_host_lengths: bool) -> tuple[torch.Tensor | None, int]:
    """Moves the rows of `inputs` (StepInputs) that start at a placeholder (module docstring), from the step in
    flight's `tokens` and `drafts`. Returns each packed request's move on the device (None: no row moved) and a
    host bound on the moves."""
    index_of = {request_id: i for i, request_id in enumerate(drafts.request_ids)}
    starts = inputs.metadata.query_start_loc_cpu
    moved = [(r, s, index_of[s.request.request_id]) for r, s in enumerate(inputs.scheduled)
             if s.request.all_token_ids[s.start] == PLACEHOLDER_TOKEN]
    if not moved:
        return None, 0
    device = tokens.device

    def longs(values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device, non_blocking=True)

    lengths = np.array([s.num_new_tokens for _, s, _ in moved])
    token_rows = np.concatenate([np.arange(starts[r], starts[r] + s.num_new_tokens) for r, s, _ in moved])
    offsets = np.concatenate([np.arange(n) for n in lengths])  # each token's place in its row
    owner = np.repeat(np.arange(len(moved)), lengths)  # each token's row among `moved`
    rows_dev = longs(token_rows)
    accepted = drafts.accepted.index_select(0, longs([i for _, _, i in moved]))  # [moved]
    moves = accepted.index_select(0, longs(owner))  # [tokens]
    # the tokens: the sample after the kept run, then the head's drafts
    firsts = longs([drafts.first_samples[i] for _, _, i in moved]) + accepted
    ids = tokens.index_select(0, firsts).index_select(0, longs(owner))
    if drafts.drafts.shape[1]:
        width = drafts.drafts.shape[1]
        draft_index = longs(np.array([i for _, _, i in moved])[owner] * width + np.maximum(offsets - 1, 0))
        from_drafts = drafts.drafts.reshape(-1).index_select(0, draft_index)
        ids = torch.where(longs(offsets) > 0, from_drafts, ids)
    inputs.input_ids.index_copy_(0, rows_dev, ids)
    # positions, slots and context lengths
    positions = longs(np.concatenate([np.arange(s.start, s.start + s.num_new_tokens) for _, s, _ in moved])) + moves
    if inputs.positions.dim() == 2:
        inputs.positions.index_copy_(0, rows_dev, inputs.positions.index_select(0, rows_dev) + moves[:, None])
    else:
        inputs.positions.index_copy_(0, rows_dev, positions)
    metadata = inputs.metadata
    tables = metadata.block_tables.index_select(0, longs(np.array([r for r, _, _ in moved])[owner]).to(metadata.block_tables.device))
    blocks = tables.gather(1, (positions // block_size)[:, None].to(tables.device)).squeeze(1).long()
    metadata.slot_mapping.index_copy_(0, rows_dev, blocks * block_size + positions % block_size)
    batch_rows = longs([r for r, _, _ in moved])
    metadata.seq_lens.index_copy_(0, batch_rows, (metadata.seq_lens.index_select(0, batch_rows) + accepted).to(metadata.seq_lens.dtype))
    bound = max(drafts.num_verified[i] for _, _, i in moved)  # a row moves by at most the drafts it verified
    _host_lengths(metadata, exact_host_lengths, [r for r, _, _ in moved], bound)
    if states:
        _restore_kept_states(states, drafts, [(s, i) for _, s, i in moved], accepted, longs)
    shifts = torch.zeros(len(inputs.scheduled), dtype=torch.int64, device=device)
    shifts.index_copy_(0, batch_rows, accepted)
    return shifts, bound


def _host_lengths(metadata, exact: bool, rows: list[int], bound: int) -> None:
    """The host copies of the context lengths: read back where that costs nothing (the CPU), else raised to a bound."""
    if exact:
        seq_lens = metadata.seq_lens.tolist()
    else:
        seq_lens = list(metadata.seq_lens_cpu)
        for r in rows:
            seq_lens[r] += bound
    metadata.seq_lens_cpu[:] = seq_lens[: len(metadata.seq_lens_cpu)]
    if metadata.num_decodes:
        metadata.max_decode_seq_len = max(metadata.max_decode_seq_len, max(seq_lens[: metadata.num_decodes]))


def _restore_kept_states(states: list[GatedDeltaStates], drafts: DeviceDrafts, moved: list, accepted: torch.Tensor, longs) -> None:
    """Each moved request's live state becomes its state after the kept run (module docstring)."""
    sources_flat, offsets, live = [], [], []
    for s, i in moved:
        sources = drafts.state_sources[i]
        offsets.append(len(sources_flat))
        sources_flat.extend(sources)
        live.append(s.state.slot)
    source = longs(sources_flat).index_select(0, longs(offsets) + accepted)
    target = longs(live)
    for layer in states:
        layer.conv.index_copy_(0, target, layer.conv.index_select(0, source))
        layer.recurrent.index_copy_(0, target, layer.recurrent.index_select(0, source))
