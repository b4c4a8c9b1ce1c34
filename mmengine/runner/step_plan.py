"""A step as plain data: what the driver sends every tensor-parallel rank once a step, and what rank 0 sends back.

The ranks keep each request's state between steps (`worker.py`'s mirror of it), so a decode step carries a
few numbers a request: where its tokens start, how many, its new tokens since the last plan, its blocks.

```
StepPlan
  forget          ids of requests that left (finished, aborted) since the last plan: their state goes
  kept_tokens     penalized requests' tokens kept by an n-gram verify step, into each rank's penalty counts first
  new_requests    NewRequest: prompt ids, items (encoder inputs with them), M-RoPE positions, sampling params
  rows            PlannedRow per scheduled request: span, items to encode, tokens appended since the last plan
  block_tables    request id -> KV block ids (and window_tables for a window pool)
  freed / stale   encoder outputs to drop (the driver's encoder cache evicted them)
  lora_*          each request's adapter slot, and adapters to load into slots first
  kv_moves        KV blocks to copy to and from each rank's host tier first (distributed/kv_host_moves.py)
  encoder_host    encoder outputs each rank keeps in host memory as it frees them, or drops (encoder_host_moves.py)
  draft_depths    a draft head's chain length for each sampling request (SchedulerOutput's)
  state_copies    hybrid models: checkpoints of rows launched ahead, copied on each rank before the step
StepResult (rank 0)
  tokens, logprobs, prompt_logprobs (TokenLogprobs: plain data), num_encoder_runs
  drafts          a draft head's whole chain for each sampling request (drafted on the ranks in the step), and
  draft_counts    how many of them were computed within the request's blocks
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmengine.core.request import MMItem
from mmengine.distributed.encoder_host_moves import EncoderHostMoves
from mmengine.distributed.kv_host_moves import KVMoves
from mmengine.outputs import TokenLogprobs
from mmengine.sample.params import SamplingParams

if TYPE_CHECKING:
    from mmengine.runner.cuda_graphs import ReplayCounts


@dataclass
class NewRequest:
    """A request the ranks have not seen yet (its first step, or its first after the ranks forgot it)."""

    request_id: str
    prompt_token_ids: list[int]
    mm_items: list[MMItem]
    mrope_positions: Any
    sampling_params: SamplingParams


@dataclass
class PlannedRow:
    """One scheduled request of the step (ScheduledRequest without the live Request)."""

    request_id: str
    start: int
    num_new_tokens: int
    encoder_items: list[int]
    token_base: int  # the request's tokens from this index on are `new_tokens` (what the ranks lack)
    new_tokens: list[int]
    num_prefix_hit_tokens: int
    grammar_mask: Any = None  # the row's token bitmasks (host int32 [1 + drafts, words]) when a grammar constrains it
    state: Any = None  # hybrid models: the recurrent state's StatePlan (slot, reset or restore, checkpoints to save)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative decoding: drafts this step verifies
    restored_items: list[int] = field(default_factory=list)  # items each rank copies back from its encoder host tier


@dataclass
class StepPlan:
    rows: list[PlannedRow] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    kept_tokens: list[tuple[str, list[int]]] = field(default_factory=list)  # (request id, tokens) to count, before the step
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    window_tables: dict[str, list[int]] | None = None
    freed_encoder_hashes: list[str] = field(default_factory=list)
    stale_encoder_hashes: list[str] = field(default_factory=list)
    lora_slots: dict[str, int] = field(default_factory=dict)  # request id -> its adapter's slot (SchedulerOutput's)
    encoder_lora_slots: dict[str, int] = field(default_factory=dict)
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)  # (slot, LoRAAdapter or None: cleared), before the step
    kv_moves: KVMoves | None = None  # copies between each rank's KV blocks and its host tier, before the step
    encoder_host: EncoderHostMoves | None = None  # encoder outputs each rank keeps in or drops from its host tier
    draft_depths: dict[str, int] | None = None  # a draft head's chain length per sampling request (None: the full k)
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, checkpoint) slots, before the step


@dataclass
class PromptLogprobsPart:
    """One request's prompt log-probabilities from one step's chunk."""

    request_id: str
    first_position: int
    entries: list[TokenLogprobs]


@dataclass
class StepResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: list[PromptLogprobsPart] = field(default_factory=list)
    num_encoder_runs: int = 0
    seconds: float = 0.0  # rank 0's time in the step, from the plan's arrival to its reply (the rest is the channel's)
    graph_replays: ReplayCounts | None = None  # rank 0's CUDA graph replays so far (None: no graphs captured)
    # a draft head's whole chain for each sampling request (made within the step: head_drafter.py), and the leading
    # drafts of each computed within its blocks (LaunchedStep.drafts: a step launched ahead took the whole chain)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    draft_counts: dict[str, int] = field(default_factory=dict)
    cascade: tuple[int, int, int] = (0, 0, 0)  # rank 0's cascade steps, groups and tokens so far
