"""The sampling half of a launched step: its logits -> tokens, on the device, without waiting for them.

It owns what happens between a step's logits and the start of their copy to the host: each constrained row's
grammar mask, logit bias, the presence/frequency/repetition penalties (a verify row's drafts before it counted as
output, as the device holds them), the sampler, the output counts of what was sampled (a draft head's kept runs
counted on the device, runner/head_drafter.py), the head's drafts, and the log-probabilities asked for (a prompt's
too). The runner holds the state (PenaltyState, BitmaskFiller, Sampler, TokenReadback) and passes it in: these are
functions over plain arguments, so a worker may swap a piece (its planned grammar masks) on the runner.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmengine.core.request import Request
from mmengine.core.scheduler import ScheduledRequest
from mmengine.runner.head_drafter import DeviceDrafts, HeadDrafter
from mmengine.runner.launched_step import LaunchedStep, PendingSample, PromptLogprobs, TokenReadback
from mmengine.sample.penalties import PenaltyState, apply_logit_bias
from mmengine.sample.sampler import Sampler, token_logprobs
from mmengine.sample.structured_output.masks import BitmaskFiller, apply_token_bitmask


def device_longs(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor on the device without waiting for it: a blocking copy would wait for
    the step's forward, which is still running when sampling is prepared."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    scheduled: list[ScheduledRequest], device: torch.device) -> list[PromptLogprobs]:
    """For the requests that asked (SamplingParams.prompt_logprobs): the log-probability of each
    prompt token this step's chunk predicts (the token after each position), and the best k."""
    found, row = [], 0
    for s in scheduled:
        request, k = s.request, s.request.sampling_params.prompt_logprobs
        last = min(s.end, request.num_prompt_tokens - 1)  # the last prompt position predicts the first output
        if k is not None and last > s.start:
            logits = compute_logits(hidden[row : row + last - s.start])
            targets = device_longs(request.prompt_token_ids[s.start + 1 : last + 1], device)
            found.append(PromptLogprobs(request, s.start + 1, targets, *token_logprobs(logits, targets, k), k))
        row += s.num_new_tokens
    return found


def sample_step(pending: PendingSample, *, device: torch.device, sampler: Sampler, penalties: PenaltyState,
                grammar_masks: BitmaskFiller, readback: TokenReadback, drafter: HeadDrafter | None) -> LaunchedStep:
    """Samples a launched step's logits (under each constrained row's grammar mask) and starts
    the copy of its tokens to the host."""
    logits, sampled = pending.logits, pending.sampled
    constrained = [row for row, s in enumerate(sampled) if s.request.grammar is not None]
    drafts_before = drafts_before_rows(sampled) if any(s.draft_token_ids for s in sampled) else None
    if constrained:
        drafts_before = drafts_before or drafts_before_rows(sampled)
        bitmask = grammar_masks.fill([sampled[row].request.grammar for row in constrained],
                                     [drafts_before[row] for row in constrained])
        rows = device_longs(constrained, device)
        logits = apply_token_bitmask(logits, rows, bitmask.to(device, non_blocking=True))
    params = [s.request.sampling_params for s in sampled]
    biased = [(row, p.logit_bias) for row, p in enumerate(params) if p.logit_bias]
    if biased:
        logits = apply_logit_bias(logits, biased)
    # A finished request's row here is the extra step of async scheduling, whose token is dropped.
    penalized = [row for row, p in enumerate(params) if p.penalized and not sampled[row].request.is_finished]
    if penalized:
        batch_rows = device_longs(penalized, device)
        state_rows = device_longs([penalties.row_of(sampled[row].request.request_id,
                                                    sampled[row].request.prompt_token_ids) for row in penalized], device)
        columns = [[params[row].presence_penalty for row in penalized], [params[row].frequency_penalty for row in penalized],
                   [params[row].repetition_penalty for row in penalized]]
        presence, frequency, repetition = torch.tensor(columns, dtype=torch.float32).to(device, non_blocking=True)
        # a verify row counts the drafts before it as output, as the device holds them (a row launched ahead
        # has placeholders on the host); its request's kept run is counted once known (with a draft head on the
        # device, count_kept_runs; else count_kept_tokens, once booked), the others' tokens as they are sampled
        logits = penalties.apply(logits, batch_rows, state_rows, presence, frequency, repetition,
                                 _penalty_draft_counts(penalties, pending.input_ids, penalized, drafts_before, device))
    tokens = sampler(logits, params, [s.request.generator for s in sampled], pending.sampling)
    if penalized:
        plain = [i for i, row in enumerate(penalized) if not sampled[row].draft_token_ids]
        if len(plain) == len(penalized):
            penalties.count(state_rows, tokens.index_select(0, batch_rows))
        elif plain:
            index = device_longs(plain, device)
            penalties.count(state_rows.index_select(0, index), tokens.index_select(0, batch_rows.index_select(0, index)))
    # a draft head drafts now, on the device, so the drafts come back with the tokens (runner/head_drafter.py)
    drafts = drafter.draft(tokens, sampled) if drafter is not None else None
    if penalized and drafts is not None and drafts_before is not None:
        count_kept_runs(penalties, tokens, sampled, penalized, batch_rows, state_rows, drafts_before, drafts, device)
    launched = readback.start([s.request.request_id for s in sampled], tokens, drafts)
    launched.prompt_logprobs = pending.prompt_logprobs
    asked = [row for row, p in enumerate(params) if p.logprobs is not None]
    if asked:  # read back with the tokens (the copy waits for them anyway)
        ks = [params[row].logprobs for row in asked]
        index = device_longs(asked, device)
        launched.logprobs = (asked, *token_logprobs(logits.index_select(0, index), tokens.index_select(0, index), max(ks)), ks)
    return launched


def _penalty_draft_counts(penalties: PenaltyState, input_ids: torch.Tensor | None, penalized: list[int],
                          drafts_before: list[list[int]] | None, device: torch.device) -> torch.Tensor | None:
    """[len(penalized), vocab] the drafts before each penalized row (the input tokens of the rows after its
    run's first, up to its own), counted on the device; None when no row comes after drafts."""
    pairs = [(i, row - back) for i, row in enumerate(penalized) for back in range(len(drafts_before[row]) if drafts_before else 0)]
    if not pairs:
        return None
    rows, sources = zip(*pairs)
    return penalties.tokens_counted(len(penalized), device_longs(list(rows), device),
                                    input_ids.index_select(0, device_longs(list(sources), device)))


def count_kept_runs(penalties: PenaltyState, tokens: torch.Tensor, sampled: list[ScheduledRequest], penalized: list[int],
                    batch_rows: torch.Tensor, state_rows: torch.Tensor, drafts_before: list[list[int]],
                    drafts: DeviceDrafts, device: torch.device) -> None:
    """A draft head's penalized verify rows: the tokens of each kept run (its positions up to the accepted count,
    on the device) go into the request's counts now, so a step launched before this one is read penalizes by
    them. (A run that booking cuts ends its request, whose counts go.)"""
    verify = [i for i, row in enumerate(penalized) if sampled[row].draft_token_ids]
    if not verify:
        return
    order = {request_id: r for r, request_id in enumerate(drafts.request_ids)}
    index = device_longs(verify, device)
    rows_in_drafts = [order[sampled[penalized[i]].request.request_id] for i in verify]
    accepted = drafts.accepted.index_select(0, device_longs(rows_in_drafts, device))
    positions = device_longs([len(drafts_before[penalized[i]]) for i in verify], device)  # each row's place in its run
    penalties.count(state_rows.index_select(0, index), tokens.index_select(0, batch_rows.index_select(0, index)),
                    positions <= accepted)


def count_kept_tokens(penalties: PenaltyState, request: Request, tokens: list[int], device: torch.device) -> None:
    """A penalized request's tokens kept by a verify step, into its output counts."""
    row = penalties.row_of(request.request_id, request.prompt_token_ids)
    penalties.count(device_longs([row] * len(tokens), device), device_longs(tokens, device))


def drafts_before_rows(sampled: list[ScheduledRequest]) -> list[list[int]]:
    """For each logits row, the drafts its position comes after: a verify step's rows are consecutive,
    the request's last token's first (none), then one per draft."""
    before: list[list[int]] = []
    for row, s in enumerate(sampled):
        index = len(before[-1]) + 1 if row and sampled[row - 1] is s else 0
        before.append(s.draft_token_ids[:index])
    return before
