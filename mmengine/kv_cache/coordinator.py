"""CacheCoordinator: a prefix hit that holds in every cache group of the decoder.

A decoder's layers fall into groups that cache differently. Full-attention layers keep every token's
K/V in blocks (KVCacheManager: the verified hash chain, device and host tiers). Gated DeltaNet layers
(Qwen3.5) keep one live state per running request and sparse checkpoints (RecurrentStateManager). A
request may skip its first n tokens only if every group can give it what those tokens left: for a
hybrid decoder, the longest verified block chain whose end has a checkpoint. Blocks of the chain past
that point are still taken: the stretch after the checkpoint is recomputed for the recurrent layers
while the attention layers read its cached K/V and write nothing (slot -1 below num_prefix_hit_tokens).

Sliding-window layers (Gemma 4's) keep their blocks in a pool of their own (SlidingWindowManager) and
give back those that left the window; a hit holds there when the blocks of the window before its end
are cached, so the full chain's hit is shortened to the longest prefix that has them.

The scheduler asks here for the hit when it admits a request, whether a chunk's blocks can be had (in
every pool), and tells the groups when a chunk is planned, when it is booked and when the request
leaves; the managers keep their own books.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mmengine.core.request import Request
from mmengine.kv_cache.block_pool import KVBlock
from mmengine.kv_cache.host_tier import HostBlock
from mmengine.kv_cache.manager import KVCacheManager
from mmengine.kv_cache.recurrent_state import RecurrentStateManager, StatePlan
from mmengine.kv_cache.sliding_window import SlidingWindowManager


@dataclass
class PrefixHit:
    hits: list[KVBlock]  # cached device blocks of the prefix, taken as they are
    host_hits: list[HostBlock] = field(default_factory=list)  # cached host blocks after them (a copy in, not a prefill)
    num_computed: int = 0  # tokens the request starts with (a full hit still recomputes the last)
    resume_blocks: int = 0  # recurrent groups: the blocks whose checkpointed state it starts from
    window_hits: list[KVBlock] = field(default_factory=list)  # sliding-window pool: the hit's last blocks (its window)

    @property
    def num_hit_blocks(self) -> int:
        return len(self.hits) + len(self.host_hits)


class CacheCoordinator:
    def __init__(self, kv_cache: KVCacheManager, states: RecurrentStateManager | None, block_size: int,
                 windows: SlidingWindowManager | None = None) -> None:
        self.kv_cache = kv_cache
        self.states = states
        self.windows = windows
        self.block_size = block_size

    def find_hit(self, request: Request, fresh: bool, can_pin: Callable[[str], bool]) -> PrefixHit:
        """The request's prefix hit now; `fresh` (prompt logprobs need every position) takes none."""
        if fresh:
            return PrefixHit([])
        hits = self.kv_cache.get_computed_blocks(request)
        # A hybrid model resumes at a checkpoint, and checkpoints die with their device blocks: host hits
        # past them would only spare the recomputation's K/V writes, for a copy.
        host_hits = [] if self.states is not None else self.kv_cache.get_host_hits(request, hits, can_pin)
        return self._hit(request, hits, host_hits)

    def without_host_hits(self, request: Request, hit: PrefixHit) -> PrefixHit:
        return self._hit(request, hit.hits, [])

    def _hit(self, request: Request, hits: list[KVBlock], host_hits: list[HostBlock]) -> PrefixHit:
        window_hits: list[KVBlock] = []
        if self.windows is not None:
            n, window_hits = self.windows.longest_hit(request, len(hits) + len(host_hits))
            hits, host_hits = hits[:n], host_hits[: max(0, n - len(hits))]
        hit = PrefixHit(hits, host_hits, window_hits=window_hits)
        last = request.num_tokens - 1  # a full hit still recomputes the last token: its logits are needed
        if self.states is None:
            hit.num_computed = min(hit.num_hit_blocks * self.block_size, last)
        else:
            hit.resume_blocks = self.states.resume_point(request, hit.num_hit_blocks, last)
            hit.num_computed = hit.resume_blocks * self.block_size
        return hit

    # -- blocks -------------------------------------------------------------------

    def can_allocate(self, request: Request, num_new: int, hit: PrefixHit | None = None, num_computed: int | None = None) -> bool:
        """Whether every pool has the blocks for the request to grow by num_new tokens (at admission,
        after `hit`)."""
        hits = hit.hits if hit is not None else []
        if not self.kv_cache.can_allocate(request, num_new, hits, num_computed):
            return False
        if self.windows is None:
            return True
        if hit is None:
            return self.windows.can_allocate(request, num_new, num_computed=num_computed)
        return self.windows.can_allocate(request, num_new, hit.window_hits, hit.num_hit_blocks, num_computed)

    def allocate(self, request: Request, num_new: int, hit: PrefixHit | None = None, num_computed: int | None = None) -> None:
        if hit is None:
            self.kv_cache.allocate(request, num_new, num_computed=num_computed)
        else:
            self.kv_cache.allocate(request, num_new, hit.hits, num_computed, hit.host_hits)
        if self.windows is not None:
            if hit is None:
                self.windows.allocate(request, num_new, num_computed=num_computed)
            else:
                self.windows.allocate(request, num_new, hit.window_hits, hit.num_hit_blocks, num_computed)

    # -- a chunk planned, booked; a request leaving ----------------------------

    def plan_admitted(self, request: Request, hit: PrefixHit, num_new: int) -> StatePlan | None:
        """The recurrent groups' part of an admitted request's first chunk: its live slot, started from
        the hit's checkpoint, and a branch point where the KV hit runs past it."""
        if self.states is None:
            return None
        bs = self.block_size
        branch_end = min(hit.num_hit_blocks, (request.num_tokens - 1) // bs) * bs
        plan = self.states.admit(request, hit.resume_blocks)
        self.states.plan_saves(request, plan, hit.num_computed, num_new, branch_end if branch_end > hit.num_computed else 0)
        return plan

    def plan_running(self, request: Request, start: int, num_new: int, num_drafts: int = 0) -> StatePlan | None:
        """The recurrent groups' part of a running request's chunk; its last `num_drafts` tokens are drafts,
        after each of which the state is kept (a rejected draft's successors are rolled back from there)."""
        if self.states is None:
            return None
        plan = self.states.continue_live(request)
        self.states.plan_saves(request, plan, start, num_new)
        self.states.plan_draft_saves(request, plan, start + num_new - num_drafts, num_drafts)
        return plan

    def booked(self, request: Request) -> None:
        """The request's computed tokens moved on: its full blocks are cached, then its saves that they
        reached become visible."""
        self.kv_cache.cache_blocks(request)
        if self.windows is not None:
            self.windows.booked(request)
        if self.states is not None:
            self.states.commit(request)

    def free_past(self, request: Request, num_tokens: int) -> None:
        """Once a step is booked: the blocks past the request's first `num_tokens` tokens go back (drafts it did not
        keep, a draft head's chain), in the full-attention pool and the sliding-window (or chunked) pool alike."""
        self.kv_cache.free_past(request, num_tokens)
        if self.windows is not None:
            self.windows.free_past(request, num_tokens)

    def release(self, request: Request) -> None:
        if self.states is not None:
            self.states.release(request)
        if self.windows is not None:
            self.windows.free(request)
        self.kv_cache.free(request)

    def reset_prefix_cache(self) -> None:
        """One rule for every group (after a weight update): everything cached is forgotten, the host tier
        too, and a request running now caches nothing more in any group (full blocks, window blocks,
        recurrent checkpoints): its KV and states were computed, at least in part, before the reset. It
        runs on, and once it leaves (finished, or preempted to compute again) nothing of it remains."""
        self.kv_cache.reset_prefix_cache()
        if self.windows is not None:
            self.windows.reset_prefix_cache()
        if self.states is not None:
            self.states.reset()
