"""SlidingWindowManager: the blocks of the sliding-window layers (Gemma 4's), a pool of their own.

A sliding layer's query at position q sees keys q - W < k <= q (picture spans only widen it forward).
So once a request has computed c tokens, its later queries never read a key before c - W + 1, and its
sliding blocks wholly before that go back to the pool: the request's table keeps the null block there
(block 0, held forever and never written; the kernels skip or mask what lies left of the window). The
full-attention layers keep every block in their own pool (KVCacheManager), so a long context costs the
sliding layers only its window.

Freed blocks stay cached under the full chain's hashes until reallocated, like the full pool's: a prefix
hit of n blocks holds only if the blocks of the window before its end are cached here too. They have
no chain of their own here (the blocks before them are gone), so a lookup verifies each by its token
key and its parent's hash. The coordinator shortens a full-chain hit to the longest prefix whose window
is found.

What to evict first: a window block only serves hits that end within a window after it. A request's
last blocks (given back when it leaves) serve the commonest hits, a prompt repeated or extended (the
next turn of a chat); a block that left the window mid-request serves only a hit ending mid-request,
which a later prompt sharing just that prefix would need. So blocks leaving the window go to the head of
the free queue (evicted first), unless they were taken as a hit's window already (a shared prefix's end:
proven useful, they go to the tail like the rest). Without this, a long request's stream of freed blocks
would push every earlier prompt's end out of a small pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmengine.core.request import Request
from mmengine.kv_cache.block_hash import block_key
from mmengine.kv_cache.block_pool import BlockPool, KVBlock, PoolBacked
from mmengine.kv_cache.manager import cdiv

NULL_BLOCK_ID = 0


class SlidingWindowManager(PoolBacked):
    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the sliding-window pool needs the null block and one more, got {num_blocks} blocks")
        self.block_size = block_size
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, on_uncache=self._forget_served, empty_first=True)
        self._served: set[int] = set()  # cached blocks taken as a hit's window since they were cached
        (self.null_block,) = self.pool.take(1)  # the oldest free block: id 0
        assert self.null_block.block_id == NULL_BLOCK_ID
        self._req_blocks: dict[str, list[KVBlock]] = {}  # by block index; the null block where freed
        self._req_block_ids: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading block indices already offered to the cache
        self._uncacheable: set[str] = set()  # running when the cache was reset: they cache nothing more
        self.num_freed_out_of_window = 0  # blocks given back while their request ran

    def first_needed_block(self, num_computed: int) -> int:
        """The first block a request that has computed num_computed tokens may still read."""
        return max(0, num_computed - self.window + 1) // self.block_size

    # -- lookup ---------------------------------------------------------------

    def longest_hit(self, request: Request, num_full_hit_blocks: int) -> tuple[int, list[KVBlock]]:
        """(n, blocks): the longest n <= num_full_hit_blocks whose window is cached here, and those
        blocks (indices first_needed_block(..) to n - 1)."""
        if not self.enable_prefix_caching or num_full_hit_blocks == 0:
            return 0, []
        found = [self._lookup(request, index) for index in range(num_full_hit_blocks)]
        last = request.num_tokens - 1
        run = 0  # cached blocks in a row ending at index n - 1
        runs = []
        for block in found:
            run = run + 1 if block is not None else 0
            runs.append(run)
        for n in range(num_full_hit_blocks, 0, -1):
            lo = self.first_needed_block(min(n * self.block_size, last))
            if runs[n - 1] >= n - lo:
                return n, found[lo:n]
        return 0, []

    def _lookup(self, request: Request, index: int) -> KVBlock | None:
        block = self.pool.lookup(request.block_hashes[index], block_key(request, index, self.block_size), None)
        parent_hash = request.block_hashes[index - 1] if index else None
        if block is None or block.parent_hash != parent_hash:
            return None
        return block

    # -- allocation -----------------------------------------------------------

    def blocks_needed(self, request: Request, num_new_tokens: int, hits: Sequence[KVBlock] = (), num_hit_blocks: int = 0,
                      num_computed: int | None = None) -> int:
        """Free blocks used up if the request grows to num_computed + num_new_tokens tokens; at admission,
        `hits` are the cached window blocks of a hit of num_hit_blocks blocks."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        held = len(self._req_blocks.get(request.request_id, ())) or num_hit_blocks
        new = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - held)
        return new + sum(1 for block in hits if block.ref_cnt == 0)

    def can_allocate(self, request: Request, num_new_tokens: int, hits: Sequence[KVBlock] = (), num_hit_blocks: int = 0,
                     num_computed: int | None = None) -> bool:
        return self.blocks_needed(request, num_new_tokens, hits, num_hit_blocks, num_computed) <= self.pool.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int, hits: Sequence[KVBlock] = (), num_hit_blocks: int = 0,
                 num_computed: int | None = None) -> None:
        """Takes the blocks (the caller has checked can_allocate). At admission the hit's blocks before
        its window are the null block."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        blocks = self._req_blocks.setdefault(request.request_id, [])
        block_ids = self._req_block_ids.setdefault(request.request_id, [])
        if num_hit_blocks:
            assert not blocks, "hits are only taken when a request is admitted"
            skipped = num_hit_blocks - len(hits)
            self.pool.touch(list(hits))
            self._served.update(b.block_id for b in hits)
            blocks.extend([self.null_block] * skipped + list(hits))
            block_ids.extend([NULL_BLOCK_ID] * skipped + [b.block_id for b in hits])
            self._num_cached[request.request_id] = num_hit_blocks
        needed = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks))
        if needed:
            taken = self.pool.take(needed)
            blocks.extend(taken)
            block_ids.extend(b.block_id for b in taken)

    def booked(self, request: Request) -> None:
        """The request's computed tokens moved on: its newly full blocks join the cache, then the blocks
        its later queries can no longer see go back to the pool (oldest first, so evicted first)."""
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks)
        block_ids = self._req_block_ids[request.request_id]
        freed = []
        for index in range(self.first_needed_block(request.num_computed_tokens)):
            if blocks[index] is not self.null_block:
                freed.append(blocks[index])
                blocks[index], block_ids[index] = self.null_block, NULL_BLOCK_ID
        self.pool.release([b for b in freed if b.block_id not in self._served], evict_first=True)
        self.pool.release([b for b in freed if b.block_id in self._served])
        self.num_freed_out_of_window += len(freed)

    def free_past(self, request: Request, num_tokens: int) -> None:
        """Gives back the request's blocks past those that hold its first `num_tokens` tokens (taken for a verify
        step's rejected drafts or a draft head's chain), as KVCacheManager.free_past does the full pool's. They lie
        past every computed token, so none is cached, shared or the null block; uncached, they join the empty queue
        (taken again before any cached block is evicted). The block-id list is replaced, not shortened: a step
        already launched keeps the table it read."""
        blocks = self._req_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        past = blocks[keep:]
        shared = [b.block_id for b in past if b is self.null_block or b.is_cached or b.ref_cnt != 1]
        if shared:
            raise RuntimeError(f"window blocks {shared} of {request.request_id} past its {num_tokens} tokens are cached or shared")
        del blocks[keep:]
        self._req_block_ids[request.request_id] = self._req_block_ids[request.request_id][:keep]
        self.pool.release(past)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock]) -> None:
        if request.request_id in self._uncacheable:
            return
        start = self._num_cached.get(request.request_id, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for index in range(start, num_full):
            block = blocks[index]
            if block is self.null_block or block.is_cached:
                continue
            parent_hash = request.block_hashes[index - 1] if index else None
            # False when another block holds this hash already: this one stays private
            self.pool.cache(block, request.block_hashes[index], block_key(request, index, self.block_size), None,
                            parent_hash=parent_hash)
        self._num_cached[request.request_id] = max(start, num_full)

    def hold_window(self, request: Request, num_blocks: int) -> list[KVBlock]:
        """References once more the cached blocks of the window before the request's first num_blocks
        blocks end (a prefix-sharing group's hold: the members' hit needs them); [] when one is gone.
        `release_held` gives the references back."""
        window = [self._lookup(request, index) for index in range(self.first_needed_block(num_blocks * self.block_size), num_blocks)]
        if not window or any(block is None for block in window):
            return []
        self.pool.touch(window)
        self._served.update(block.block_id for block in window)
        return window

    def release_held(self, blocks: list[KVBlock]) -> None:
        self.pool.release(blocks[::-1])

    def _forget_served(self, block: KVBlock) -> None:
        self._served.discard(block.block_id)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._req_block_ids.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self._uncacheable.discard(request.request_id)
        self.pool.release([b for b in reversed(blocks) if b is not self.null_block])

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block; the requests running now cache nothing more (their windows hold
        KV computed before the reset)."""
        self.pool.reset_cache()
        self._uncacheable = set(self._req_blocks)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids by block index, NULL_BLOCK_ID where freed (a live list: read it only)."""
        return self._req_block_ids.get(request_id, [])

    def num_held_blocks(self, request_id: str) -> int:
        return sum(1 for b in self._req_blocks.get(request_id, ()) if b is not self.null_block)
