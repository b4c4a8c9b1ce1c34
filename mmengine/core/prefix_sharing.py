"""PrefixSharing: the scheduler's books for prefix-sharing groups and cache-affinity admission.

A batch added at once (generate()) is planned into groups by prefix_groups.py and queued group
by group. Then, for each group:
- its shared prefix is computed once: the first member computes it, the others wait for it
  (the scheduler's wait-for-hit rule) and take it from the prefix cache;
- once a member has computed the prefix, the group holds those blocks (one extra reference),
  so LRU cannot evict them while members still wait; the last member to finish releases them;
- a member is admitted only when the KV blocks it will need up to its max_tokens fit beside
  what running requests will still need (BatchLLM caps a batch by the KV memory it needs), so
  admitting the next group never forces a preemption that recomputes a member. A request
  skipped too often (the scheduler's starvation bound) bypasses this gate, and so does a
  request when nothing runs.
Holds give way to requests: before a running request preempts anyone for blocks (itself included),
for a starving request that does not fit, and whenever a step would otherwise schedule nothing, holds
that keep a block no running request uses, in the KV pool or the window pool, are released, most
recent first (groups of different batches may hold the same blocks: all their holds go); the blocks
stay cached. So no hold ever stands between the oldest running request and its next chunk: at worst
it runs alone, and a lone request always fits (intake refuses prompt + max_tokens beyond the KV cache,
the window pool holds a window and a full chunk, start-up refuses a token budget below a picture).

Waiting requests are tried longest cached prefix first (cache affinity), with the scheduler's
starvation bound. Requests in no group are never gated or held.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from mmengine.kv_cache.block_hash import BlockHash
from mmengine.kv_cache.block_pool import KVBlock
from mmengine.kv_cache.manager import KVCacheManager, cdiv
from mmengine.kv_cache.sliding_window import SlidingWindowManager
from mmengine.core.prefix_groups import group_order, plan_prefix_groups
from mmengine.core.request import Request


@dataclass(eq=False)
class LiveGroup:
    """A planned group while any of its members is unfinished."""

    prefix: tuple[BlockHash, ...]
    members: set[str]  # ids of unfinished members
    held: list[KVBlock] = field(default_factory=list)  # the shared prefix's blocks, once computed
    window_held: list[KVBlock] = field(default_factory=list)  # the sliding-window pool's blocks of its end

    @property
    def num_shared_blocks(self) -> int:
        return len(self.prefix)


class PrefixSharing:
    def __init__(self, kv_cache: KVCacheManager, block_size: int, max_model_len: int, enabled: bool,
                 windows: SlidingWindowManager | None = None) -> None:
        """`windows`: a sliding-window model's window pool: a hold also keeps the window before the
        prefix's end there, without which the held chain is no hit."""
        self.kv_cache = kv_cache
        self.windows = windows
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enabled = enabled and kv_cache.enable_prefix_caching
        self.groups: list[LiveGroup] = []  # live groups; one moves to the end when it takes its hold
        self._group_of: dict[str, LiveGroup] = {}
        self._running: Sequence[Request] = ()
        self._reserve: int | None = None  # blocks running requests may still take, this admission pass
        self.num_groups_planned = 0
        self.shared_tokens_planned = 0  # (members - 1) * shared prefix, summed over planned groups
        # Group-prefix tokens members took from the prefix cache at first admission. It can exceed
        # the plan when a prefix was already cached before its group started.
        self.shared_tokens_achieved = 0
        self.num_holds_released_early = 0  # holds given up under KV pressure before their group finished

    # -- planning -------------------------------------------------------------

    def plan(self, requests: Sequence[Request]) -> list[Request]:
        """Plans groups over a batch of just-added requests; returns them in queue order."""
        if not self.enabled or len(requests) < 2:
            return list(requests)
        chains = [r.block_hashes[: r.num_prompt_tokens // self.block_size] for r in requests]
        groups = plan_prefix_groups(chains)
        for group in groups:
            live = LiveGroup(tuple(group.prefix), {requests[i].request_id for i in group.members})
            self.groups.append(live)
            for i in group.members:
                self._group_of[requests[i].request_id] = live
            self.num_groups_planned += 1
            self.shared_tokens_planned += group.num_saved_blocks * self.block_size
        order = group_order(
            len(requests), groups, lambda i: requests[i].sampling_params.max_tokens / requests[i].num_prompt_tokens
        )
        return [requests[i] for i in order]

    def group_of(self, request: Request) -> LiveGroup | None:
        return self._group_of.get(request.request_id)

    # -- admission ------------------------------------------------------------

    def admission_order(self, waiting: Sequence[Request], window: int, starving: int) -> list[tuple[int, Request]]:
        """(queue position, request) in the order admission tries them. With sharing on, the first
        `window` requests go requests skipped `starving` times first (in queue order), then longest
        cached prefix first; the rest of the queue follows in order."""
        positioned = list(enumerate(waiting))
        if not self.enabled:
            return positioned
        head, rest = positioned[:window], positioned[window:]
        head.sort(key=lambda pr: (
            pr[1].num_admission_skips < starving, -self.kv_cache.num_cached_prefix_blocks(pr[1]), pr[0]
        ))
        return head + rest

    def begin_admission(self, running: Sequence[Request]) -> None:
        self._running = running
        self._reserve = None

    def admits(self, request: Request, hits: list[KVBlock], num_computed: int, starving: bool) -> bool:
        """The KV gate for group members: everything it will need fits beside what running requests
        will still need. Requests in no group, starving ones, and any when nothing runs pass."""
        if not self._gated(request, starving):
            return True
        final = self._final_kv_tokens(request)
        need = self.kv_cache.blocks_needed(request, max(0, final - num_computed), hits, num_computed)
        return need + self._reserve <= self.kv_cache.num_free_blocks

    def surely_refused(self, request: Request, starving: bool) -> bool:
        """Whether the gate refuses the request even if every full block of it were a hit: then the
        scheduler need not look its blocks up (the costly part of trying a long prompt)."""
        if not self._gated(request, starving):
            return False
        best = cdiv(self._final_kv_tokens(request), self.block_size) - len(request.block_hashes)
        return best + self._reserve > self.kv_cache.num_free_blocks

    def _gated(self, request: Request, starving: bool) -> bool:
        if starving or request.request_id not in self._group_of or not self._running:
            return False
        if self._reserve is None:
            self._reserve = sum(self._blocks_still_needed(r) for r in self._running)
        return True

    def admitted(self, request: Request, num_computed: int) -> None:
        """Books an admitted request (already allocated and running)."""
        if self._reserve is not None:
            self._reserve += self._blocks_still_needed(request)
        group = self._group_of.get(request.request_id)
        if group is not None and request.num_preemptions == 0:
            self.shared_tokens_achieved += min(num_computed, group.num_shared_blocks * self.block_size)

    def _final_kv_tokens(self, request: Request) -> int:
        """KV positions the request has when it finishes at max_tokens (its last token is never fed back)."""
        return min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.max_model_len) - 1

    def _blocks_still_needed(self, request: Request) -> int:
        return max(0, cdiv(self._final_kv_tokens(request), self.block_size) - len(self.kv_cache.block_ids(request.request_id)))

    # -- holds ----------------------------------------------------------------

    def progressed(self, request: Request) -> None:
        """After a step computed part of the request: its group holds the prefix once it is computed."""
        group = self._group_of.get(request.request_id)
        if group is None:
            return
        # Held blocks can leave the prefix cache (reset_prefix_cache, or the encoder cache evicting
        # an image they pin); a block leaves with its descendants, so the last one tells.
        if group.held and group.held[-1].block_hash != group.prefix[-1]:
            self._release(group)
        if group.held or request.num_computed_tokens < group.num_shared_blocks * self.block_size:
            return
        group.held = self.kv_cache.hold_prefix(request, group.prefix)
        if group.held and self.windows is not None:
            group.window_held = self.windows.hold_window(request, group.num_shared_blocks)
        if group.held:  # most recently held last: released first under pressure
            self.groups.remove(group)
            self.groups.append(group)

    def finished(self, request: Request) -> None:
        group = self._group_of.pop(request.request_id, None)
        if group is None:
            return
        group.members.discard(request.request_id)
        if not group.members:
            self._release(group)
            self.groups.remove(group)

    def release_idle_hold(self) -> bool:
        """Releases the most recent hold on a block no running request uses (only holds reference it), in
        either pool: a member past the shared prefix no longer reads the held window before its end.
        Groups of batches with an equal prefix hold the same blocks: such a block is freed once every
        hold on it is released, so the caller releases until what it needs fits."""
        holds = Counter(block.block_id for block in self.held_blocks())
        window_holds = Counter(block.block_id for group in self.groups for block in group.window_held)
        for group in reversed(self.groups):
            if _only_held(group.held, holds) or _only_held(group.window_held, window_holds):
                self._release(group)
                self.num_holds_released_early += 1
                return True
        return False

    def release_idle_holds(self) -> bool:
        released = False
        while self.release_idle_hold():
            released = True
        return released

    def _release(self, group: LiveGroup) -> None:
        if group.held:
            self.kv_cache.release_held(group.held)
            group.held = []
        if group.window_held:
            self.windows.release_held(group.window_held)
            group.window_held = []

    def held_blocks(self) -> list[KVBlock]:
        return list(itertools.chain.from_iterable(g.held for g in self.groups))

    def stats(self) -> dict[str, int]:
        return {
            "prefix_groups_planned": self.num_groups_planned,
            "prefix_group_shared_tokens_planned": self.shared_tokens_planned,
            "prefix_group_shared_tokens_achieved": self.shared_tokens_achieved,
            "prefix_group_holds_released_early": self.num_holds_released_early,
            "prefix_group_blocks_held": sum(len(g.held) for g in self.groups),
        }


def _only_held(blocks: list[KVBlock], holds: Counter[int]) -> bool:
    """Whether any of a hold's blocks is referenced by holds alone (releasing them all would free it)."""
    return any(block.ref_cnt == holds[block.block_id] for block in blocks)
