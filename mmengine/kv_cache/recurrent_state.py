"""The books of a hybrid model's recurrent states (Qwen3.5's Gated DeltaNet layers): which slot holds
each running request's live state, and which sparse checkpoints a prefix hit can resume from.

A linear-attention layer has no per-token cache to hit: a request can skip its first n tokens only by
starting from the state those n tokens leave, copied from a checkpoint. At the 9B shape a checkpoint
weighs as much as ~1,500 tokens of KV, so they are taken at a few block boundaries only:

- the prompt's last block boundary before its last token: a repeated prompt resumes there (at most
  one block recomputed);
- the last block boundary the live state passed (the request's "trailing" checkpoint, moved on as it
  goes, the previous one dropped): a finished sequence leaves one at the end of prompt + answer, so
  the next turn of a chat resumes there, and a preempted request resumes from its own;
- a branch point: a request whose KV hit runs past the nearest checkpoint recomputes that stretch
  (writing no KV: its blocks are the cached ones) and saves one at the hit's end, so the next request
  sharing the prefix resumes there.

A checkpoint is keyed by the hash of the block that ends where it was taken (the hash chains the
whole prefix, as the KV cache verifies it) and lives while that block is cached (`drop`), in LRU order
within its own slots. A save is booked when its step is scheduled and becomes visible only once the
step's tokens are booked and its block is cached (`commit`): a step that fails registers nothing.
Slots 0..num_live_slots-1 are live states; the rest are checkpoints. No tensors here: the runner copies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from mmengine.core.request import Request
from mmengine.kv_cache.block_hash import BlockHash


@dataclass
class StatePlan:
    """What a scheduled chunk does with recurrent state (ScheduledRequest.state): continue the live
    state in `slot`; first (at admission) reset it, or copy checkpoint slot `restore_from` into it;
    and copy it, as it stands at each position, into each save's slot."""

    slot: int
    reset: bool = False
    restore_from: int | None = None
    saves: list[tuple[int, int]] = field(default_factory=list)  # (position, checkpoint slot)
    # Speculative decoding: (position, draft slot) after the last token and each draft but the last, so a
    # verify step that rejects drafts can restore the state at the last position it keeps
    draft_saves: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _PendingSave:
    position: int
    slot: int
    trailing: bool


class RecurrentStateManager:
    def __init__(self, num_live_slots: int, num_checkpoints: int, block_size: int,
                 is_block_cached: Callable[[BlockHash], bool] = lambda block_hash: True, num_draft_slots: int = 0) -> None:
        """`num_draft_slots`: speculative decoding's draft states per live slot (num_speculative_tokens), laid
        out after the checkpoints: live slot i's j-th (1-based) is draft_slot(i, j)."""
        self.block_size = block_size
        self.num_live_slots = num_live_slots
        self.num_checkpoints = num_checkpoints
        self.num_draft_slots = num_draft_slots
        self._restore: dict[str, int] = {}  # a verify step rejected drafts: the draft slot its next step restores
        self._is_block_cached = is_block_cached
        self._free_live = list(range(num_live_slots - 1, -1, -1))
        self._free_checkpoints = list(range(num_live_slots + num_checkpoints - 1, num_live_slots - 1, -1))
        self._live: dict[str, int] = {}
        self._checkpoints: OrderedDict[BlockHash, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._pending: dict[str, list[_PendingSave]] = {}
        self._trailing: dict[str, BlockHash] = {}
        self._no_saves: set[str] = set()  # live when the cache was reset: their states save no checkpoint
        self.checkpoints_saved = 0
        self.checkpoint_hits = 0  # admissions that resumed from a checkpoint
        self.checkpoints_evicted = 0  # dropped for room (LRU), not because their block left the cache

    @property
    def num_slots(self) -> int:
        return self.num_live_slots + self.num_checkpoints

    @property
    def num_cached_checkpoints(self) -> int:
        return len(self._checkpoints)

    def checkpoint_slots(self) -> dict[BlockHash, int]:
        """Each cached checkpoint's slot, by the hash of the block it ends."""
        return dict(self._checkpoints)

    def live_slot(self, request_id: str) -> int | None:
        return self._live.get(request_id)

    def draft_slot(self, live_slot: int, num_tokens: int) -> int:
        """Where a verify step keeps live_slot's state after its first `num_tokens` positions (1..k)."""
        assert 1 <= num_tokens <= self.num_draft_slots, (num_tokens, self.num_draft_slots)
        return self.num_slots + live_slot * self.num_draft_slots + num_tokens - 1

    def continue_live(self, request: Request) -> StatePlan:
        """A running request's next chunk: its live state, first restored where its last verify step
        rejected drafts."""
        return StatePlan(self._live[request.request_id], restore_from=self._restore.pop(request.request_id, None))

    # -- admission ----------------------------------------------------------

    def resume_point(self, request: Request, num_hit_blocks: int, max_tokens: int) -> int:
        """The most blocks of the request's KV hit (at most `num_hit_blocks`, ending at or before
        `max_tokens`) whose end has a checkpoint; 0 when none has one (start from nothing)."""
        for k in range(min(num_hit_blocks, max_tokens // self.block_size), 0, -1):
            if request.block_hashes[k - 1] in self._checkpoints:
                return k
        return 0

    def admit(self, request: Request, resume_blocks: int) -> StatePlan:
        """Gives the request a live slot, starting from the checkpoint at `resume_blocks` (0: from nothing)."""
        assert request.request_id not in self._live, request
        slot = self._free_live.pop()
        self._live[request.request_id] = slot
        if resume_blocks == 0:
            return StatePlan(slot, reset=True)
        block_hash = request.block_hashes[resume_blocks - 1]
        self._checkpoints.move_to_end(block_hash)
        self.checkpoint_hits += 1
        return StatePlan(slot, restore_from=self._checkpoints[block_hash])

    # -- saves --------------------------------------------------------------

    def plan_saves(self, request: Request, plan: StatePlan, start: int, num_new: int, branch_end: int = 0) -> None:
        """Books the checkpoints this chunk [start, start + num_new) takes (module docstring):
        the prompt's, a branch point at `branch_end` (0: none) and the trailing one."""
        if request.request_id in self._no_saves:
            return
        end, bs = start + num_new, self.block_size
        prompt_point = (request.num_prompt_tokens - 1) // bs * bs
        wanted = {p: False for p in (prompt_point, branch_end) if start < p <= end and p > 0}
        trailing = end // bs * bs
        if trailing > start and trailing > 0:
            wanted[trailing] = trailing not in wanted  # a kept checkpoint is not also the moving one
        if any(wanted.values()):  # a trailing save still waiting for its block is superseded by this one
            self._drop_stale_trailing(request)
        for position in sorted(wanted):
            index = position // bs - 1
            if index < len(request.block_hashes) and request.block_hashes[index] in self._checkpoints:
                continue  # taken already (by another request, or before a preemption)
            slot = self._take_checkpoint_slot()
            if slot is None:
                return
            plan.saves.append((position, slot))
            self._pending.setdefault(request.request_id, []).append(_PendingSave(position, slot, wanted[position]))

    def plan_draft_saves(self, request: Request, plan: StatePlan, first_draft: int, num_drafts: int) -> None:
        """Keeps the state before each draft (after the chunk's first j tokens, j = 1..num_drafts: the
        request's last token, then the drafts before draft j) in the live slot's j-th draft slot."""
        start = first_draft - 1  # the request's last token, computed with its drafts
        plan.draft_saves = [(start + j, self.draft_slot(plan.slot, j)) for j in range(1, num_drafts + 1)]

    def rollback(self, request: Request, num_kept: int, num_scheduled: int) -> None:
        """A verify step kept the first `num_kept` of its `num_scheduled` positions (the request's computed
        tokens end there): saves booked past them saw rejected drafts and are dropped, and the live state
        is restored, before the request's next chunk, from the draft save at the last position kept."""
        pending = self._pending.get(request.request_id, [])
        for save in [save for save in pending if save.position > request.num_computed_tokens]:
            pending.remove(save)
            self._free_checkpoints.append(save.slot)
        if num_kept < num_scheduled:
            self._restore[request.request_id] = self.draft_slot(self._live[request.request_id], num_kept)

    def restored_on_device(self, request: Request) -> None:
        """The request's next chunk was launched before its verify step was read, and the runner restores its
        live state from the draft slot of the last kept position on the device (async scheduling with a draft
        head): nothing is left for that chunk to restore."""
        self._restore.pop(request.request_id, None)

    def _drop_stale_trailing(self, request: Request) -> None:
        pending = self._pending.get(request.request_id, [])
        stale = [save for save in pending if save.trailing and save.position <= request.num_computed_tokens]
        for save in stale:
            pending.remove(save)
            self._free_checkpoints.append(save.slot)

    def _take_checkpoint_slot(self) -> int | None:
        if not self._free_checkpoints and self._checkpoints:
            _, slot = self._checkpoints.popitem(last=False)
            self._free_checkpoints.append(slot)
            self.checkpoints_evicted += 1
        return self._free_checkpoints.pop() if self._free_checkpoints else None

    def commit(self, request: Request, final: bool = False) -> None:
        """Registers the request's booked saves that its computed tokens have reached, once their
        block is cached (with async scheduling, a step after its last token was a placeholder).
        `final`: the request stops running; what cannot be registered now never will be."""
        pending = self._pending.get(request.request_id)
        if not pending:
            return
        waiting = []
        for save in pending:
            index = save.position // self.block_size - 1
            computed = save.position <= request.num_computed_tokens
            block_hash = request.block_hashes[index] if computed and index < len(request.block_hashes) else None
            if block_hash is not None and block_hash in self._checkpoints:
                self._free_checkpoints.append(save.slot)  # a twin was registered first
                continue
            if block_hash is None or not self._is_block_cached(block_hash):
                if final:
                    self._free_checkpoints.append(save.slot)
                else:
                    waiting.append(save)
                continue
            self._checkpoints[block_hash] = save.slot
            self.checkpoints_saved += 1
            if save.trailing:
                self._move_trailing(request.request_id, block_hash)
        self._pending[request.request_id] = waiting

    def _move_trailing(self, request_id: str, block_hash: BlockHash) -> None:
        previous = self._trailing.get(request_id)
        self._trailing[request_id] = block_hash
        if previous is not None and previous != block_hash and previous in self._checkpoints:
            self._free_checkpoints.append(self._checkpoints.pop(previous))

    # -- leaving ------------------------------------------------------------

    def release(self, request: Request) -> None:
        """The request stops running (finished, aborted or preempted): its live slot is freed, its saves
        that were computed are kept, the others forgotten; its trailing checkpoint stays cached."""
        self.commit(request, final=True)
        for save in self._pending.pop(request.request_id, []):
            self._free_checkpoints.append(save.slot)
        self._trailing.pop(request.request_id, None)
        self._restore.pop(request.request_id, None)
        self._no_saves.discard(request.request_id)
        slot = self._live.pop(request.request_id, None)
        if slot is not None:
            self._free_live.append(slot)

    def drop(self, block_hash: BlockHash) -> None:
        """The block a checkpoint marks left the KV cache: the checkpoint can never be resumed from."""
        slot = self._checkpoints.pop(block_hash, None)
        if slot is not None:
            self._free_checkpoints.append(slot)

    def reset(self) -> None:
        """Forgets every checkpoint (reset_prefix_cache). Live states go on, but each was built (in part)
        before the reset: its booked saves are forgotten and it saves nothing more until it leaves, so no
        state from before can register under a block that a request computes after."""
        self._free_checkpoints.extend(self._checkpoints.values())
        self._checkpoints.clear()
        self._trailing.clear()
        for saves in self._pending.values():
            self._free_checkpoints.extend(save.slot for save in saves)
        self._pending.clear()
        self._no_saves = set(self._live)

    def audit(self) -> None:
        """Every slot is exactly one of: free, live, a checkpoint, a booked save (for the fuzzer's books)."""
        pending = [save.slot for saves in self._pending.values() for save in saves]
        live = sorted(self._free_live + list(self._live.values()))
        assert live == list(range(self.num_live_slots)), ("live slots", live)
        checkpoints = sorted(self._free_checkpoints + list(self._checkpoints.values()) + pending)
        assert checkpoints == list(range(self.num_live_slots, self.num_slots)), ("checkpoint slots", checkpoints)
        assert set(self._restore) <= set(self._live), ("restores of requests not running", self._restore)
