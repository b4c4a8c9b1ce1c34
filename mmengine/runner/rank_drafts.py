"""A draft head (MTP, EAGLE-3) at tensor_parallel_size > 1: the ranks draft within the step that samples, and rank 0's
reply carries the drafts with the step's tokens (one plan, one reply a step, as without a head).

```
driver                                        every rank (worker.py), after sampling the step
  blocks for the chained drafts taken         books its mirror as the driver will: a verify row keeps its
  before the step is sent (step_loop.py)      accepted drafts and the token after them; runs the head over the
  step loop books the step, asks the          kept positions (its K/V, split by heads like the target's) and
  back-off, rooms, grammars; RemoteDrafter    chains up to min(k, what the request can still emit) drafts
  hands it a prefix of rank 0's drafts  <---- rank 0: StepResult.drafts
```

A chain's first drafts do not depend on how long it runs, so the prefix the driver takes (its `wanted`, fewer where
the back-off pauses a request or its blocks end) is what TP 1's head drafts after booking the same step. The ranks
cannot know the driver's back-off or stop strings: they may draft for a request that then takes none (the work a
pause saves at TP 1 is the verify's, not the head's), and a request that ends in the step gets its head K/V of the
kept positions written (into its own blocks, as if it went on).
"""

from __future__ import annotations

from typing import Any

from mmengine.core.scheduler import ScheduledRequest
from mmengine.spec.verify import accepted_prefix


def book_mirrors(scheduled: list[ScheduledRequest], sampled: dict[str, list[int]]) -> list[ScheduledRequest]:
    """Advances each rank's mirror of the step's requests as the driver's scheduler will book them (kept positions
    computed, kept tokens appended; the next plan's rows set them from the driver's books again); returns the
    rows that sampled."""
    sampling = []
    for s in scheduled:
        if s.num_new_tokens == 0:
            continue
        request = s.request
        samples = sampled.get(request.request_id)
        if samples is None:  # a prefill chunk short of the prompt's end
            request.num_computed_tokens = s.start + s.num_new_tokens
            continue
        if s.draft_token_ids:  # a verify row: the drafts its samples accept, and the token after them
            kept = samples[: accepted_prefix(s.draft_token_ids, samples) + 1]
            request.num_computed_tokens = s.start + len(kept)
        else:
            kept = samples[-1:]
            request.num_computed_tokens = s.start + s.num_new_tokens
        request.all_token_ids.extend(kept)  # (a sampling row's tokens end at its start + 1, or at its prompt's end)
        sampling.append(s)
    return sampling


def draft_on_rank(drafter: Any, scheduled: list[ScheduledRequest], sampled: dict[str, list[int]],
                  block_tables: dict[str, list[int]], num_speculative_tokens: int, max_model_len: int) -> dict[str, list[int]]:
    """The head's pass after a sampled step on one rank (every rank runs it: its layers' collectives): each
    sampling request's drafts, up to num_speculative_tokens and what it can still emit, within its blocks."""
    wanted: dict[str, int] = {}
    for s in book_mirrors(scheduled, sampled):
        request = s.request
        num_output = request.num_tokens - request.num_prompt_tokens
        room = min(request.sampling_params.max_tokens - num_output - 1, max_model_len - request.num_tokens)
        if min(num_speculative_tokens, room) > 0:
            wanted[request.request_id] = min(num_speculative_tokens, room)
    return drafter.propose(wanted, block_tables)


class RemoteDrafter:
    """The driver's drafter at TP > 1 (the step loop's `drafter`): the drafts rank 0 sent with the step just read."""

    drafts_in_step = True  # the step loop takes the chained drafts' blocks before the step is sent

    def __init__(self) -> None:
        self.latest: dict[str, list[int]] = {}

    def received(self, drafts: dict[str, list[int]]) -> None:
        self.latest = drafts

    def propose(self, wanted: dict[str, int], block_tables: dict[str, list[int]]) -> dict[str, list[int]]:
        found, self.latest = self.latest, {}
        return {request_id: found[request_id][:n] for request_id, n in wanted.items() if found.get(request_id)}
