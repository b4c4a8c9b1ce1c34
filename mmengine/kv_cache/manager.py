"""KVCacheManager: which blocks each request holds, what is cached, and whether more can be had.

Paired methods: `can_allocate` answers without changing anything, `allocate` then commits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from mmengine.kv_cache.block_hash import BlockHash, BlockHasher, HashFunction, block_key
from mmengine.kv_cache.block_pool import BlockPool, KVBlock, PoolBacked
from mmengine.kv_cache.host_tier import HostBlock, KVCopy, KVHostTier
from mmengine.core.request import Request


class PinListener(Protocol):
    """Told when a cached KV block starts or stops needing an item's encoder output."""

    def pin(self, mm_hash: str) -> None: ...

    def unpin(self, mm_hash: str) -> None: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager(PoolBacked):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_fn: HashFunction,
        enable_prefix_caching: bool = True,
        host_tier: KVHostTier | None = None,
        pin_overlapping_items: bool = False,
    ) -> None:
        """`pin_overlapping_items`: a cached block pins every item with a token in it, not just those
        ending in it (hybrid models, which may recompute any block after their nearest checkpoint)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.host_tier = host_tier if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, on_uncache=self._on_uncache,
                              on_evict=self._on_evict if self.host_tier is not None else None)
        # Copies between the tiers booked since the runner last took them (it queues them before the step's forward)
        self._offloads: list[KVCopy] = []
        self._restores: list[KVCopy] = []
        self._handed_out: list[KVCopy] = []  # taken by the runner, until it confirms they are queued
        self.pin_listener: PinListener | None = None
        self.pin_overlapping_items = pin_overlapping_items
        self.on_block_uncached: Callable[[BlockHash], None] | None = None  # told of every hash that leaves the cache
        self._pinning: dict[str, set[KVBlock]] = {}  # mm_hash -> cached blocks that pin it
        self.hasher = BlockHasher(block_size, hash_fn)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_block_ids: dict[str, list[int]] = {}  # the same blocks' ids: each step's block tables
        # How many leading blocks of each request are in the cache chain; None once the chain
        # broke (a block's hash was already taken), after which its later blocks stay private.
        self._num_chained: dict[str, int | None] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # tokens served from the cache at admission

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    # -- hashing and lookup ---------------------------------------------------

    def hash_new_blocks(self, request: Request) -> None:
        self.hasher.update(request)

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest verified cached prefix of the request's full blocks."""
        if not self.enable_prefix_caching:
            return []
        hits: list[KVBlock] = []
        parent: int | None = None
        for index, block_hash in enumerate(request.block_hashes):
            block = self.pool.lookup(block_hash, block_key(request, index, self.block_size), parent)
            if block is None:
                break
            hits.append(block)
            parent = block.cache_id
        return hits

    def get_host_hits(
        self, request: Request, device_hits: list[KVBlock], can_pin: Callable[[str], bool] = lambda mm_hash: False
    ) -> list[HostBlock]:
        """Full blocks past the device hits that the host tier holds (verified), in order; a block that
        pins a picture only while `can_pin` says its output can be had."""
        if self.host_tier is None:
            return []
        found: list[HostBlock] = []
        for index in range(len(device_hits), len(request.block_hashes)):
            block_hash = request.block_hashes[index]
            if self.pool.is_hash_cached(block_hash):  # another block holds this hash on the device: stop
                break
            parent = request.block_hashes[index - 1] if index else None
            entry = self.host_tier.lookup(block_hash, block_key(request, index, self.block_size), parent)
            if entry is None or not all(can_pin(mm_hash) for mm_hash in entry.pins):
                break
            found.append(entry)
        return found

    def take_copies(self) -> tuple[list[KVCopy], list[KVCopy]]:
        """(device -> host, host -> device) copies to queue before the next step's forward, offloads
        first (a block evicted now may be the target of a restore)."""
        # An offload whose entry the tier has evicted since (later evictions in the same step) copies nothing
        offloads = [copy for copy in self._offloads if self.host_tier.holds(copy.entry)]
        restores = self._restores
        self._offloads, self._restores = [], []
        self._handed_out = offloads + restores
        return offloads, restores

    def abandon_copies(self) -> set[str]:
        """After copies failed to be queued: restored blocks whose copy was not queued leave the cache
        (their KV is not there) and offloads not made are forgotten. Returns the requests holding such
        blocks: they must recompute (the engine preempts them), never read a block that was not filled."""
        victims: set[str] = set()
        for copy in self._handed_out + self._offloads + self._restores:
            if copy.done:
                continue
            if not copy.restore:
                self.host_tier.forget(copy.entry)
                continue
            block = self.pool.blocks[copy.block_id]
            if block.block_hash == copy.entry.block_hash:
                self.pool.uncache(block)
            victims.update(rid for rid, ids in self._req_block_ids.items() if copy.block_id in ids)
        self._handed_out, self._offloads, self._restores = [], [], []
        return victims

    def num_cached_prefix_blocks(self, request: Request) -> int:
        """Leading blocks whose hashes are in the prefix cache, unverified: cheap, for ordering only."""
        if not self.enable_prefix_caching:
            return 0
        count = 0
        for block_hash in request.block_hashes:
            if not self.pool.is_hash_cached(block_hash):
                break
            count += 1
        return count

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation -----------------------------------------------------------

    def blocks_needed(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = (), num_computed: int | None = None
    ) -> int:
        """Free blocks used up if the request grows to num_computed + num_new_tokens tokens.

        Cached hit blocks sitting in the free queue count too: reusing them takes them out of it.
        """
        if num_computed is None:
            num_computed = request.num_computed_tokens
        held = len(self._req_blocks.get(request.request_id, ())) + len(computed_blocks)
        new = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - held)
        return new + sum(1 for block in computed_blocks if block.ref_cnt == 0)

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = (), num_computed: int | None = None
    ) -> bool:
        return self.blocks_needed(request, num_new_tokens, computed_blocks, num_computed) <= self.pool.num_free_blocks

    def allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = (), num_computed: int | None = None,
        host_hits: list[HostBlock] = (),
    ) -> None:
        """Takes the blocks; the caller has checked can_allocate (the pool raises if it runs dry).
        `host_hits` (after the device hits) get fresh blocks, cached at once, whose KV the runner
        copies back before the step's forward."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        gone = [entry.block_hash for entry in host_hits if not self.host_tier.holds(entry)]
        if gone:  # checked before anything is taken: the books stay as they were
            raise RuntimeError(f"{len(gone)} host-tier hits of {request.request_id} left the tier before their restore")
        blocks = self._req_blocks.setdefault(request.request_id, [])
        block_ids = self._req_block_ids.setdefault(request.request_id, [])
        if computed_blocks:
            assert not blocks, "hits are only taken when a request is admitted"
            self.pool.touch(list(computed_blocks))
            blocks.extend(computed_blocks)
            block_ids.extend(b.block_id for b in computed_blocks)
        self._num_chained.setdefault(request.request_id, len(computed_blocks) + len(host_hits))
        if not host_hits:
            self._take_new_blocks(blocks, block_ids, num_computed + num_new_tokens)
            return
        assert len(blocks) == len(computed_blocks), "host hits follow the device hits at admission"
        # Taking blocks evicts cached device blocks into the host tier, whose LRU must not drop the very
        # entries being restored (the hits were found before; the tier is full when it matters).
        with self.host_tier.restoring(host_hits):
            for entry, block in zip(host_hits, self.pool.take(len(host_hits))):
                parent = blocks[-1].cache_id if blocks else None
                cached = self.pool.cache(block, entry.block_hash, entry.key, parent, entry.pins, parent_hash=entry.parent_hash)
                assert cached, entry
                for mm_hash in entry.pins:  # the scheduler made their outputs resident first
                    self._pinning.setdefault(mm_hash, set()).add(block)
                    if self.pin_listener is not None:
                        self.pin_listener.pin(mm_hash)
                self._restores.append(KVCopy(entry, block.block_id, restore=True))
                blocks.append(block)
                block_ids.append(block.block_id)
            self._take_new_blocks(blocks, block_ids, num_computed + num_new_tokens)

    def _take_new_blocks(self, blocks: list[KVBlock], block_ids: list[int], num_tokens: int) -> None:
        """Fresh blocks (evicting cached ones) until the request's blocks hold num_tokens."""
        needed = max(0, cdiv(num_tokens, self.block_size) - len(blocks))
        if needed:
            taken = self.pool.take(needed)
            blocks.extend(taken)
            block_ids.extend(b.block_id for b in taken)

    def cache_blocks(self, request: Request) -> None:
        """Adds the request's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        chained = self._num_chained.get(request.request_id)
        if chained is None:
            return
        blocks = self._req_blocks[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for index in range(chained, num_full):
            block = blocks[index]
            parent = blocks[index - 1].cache_id if index else None
            if index and parent is None:
                self._num_chained[request.request_id] = None
                return
            if not block.is_cached:
                key = block_key(request, index, self.block_size)
                pins = self._items_pinned_by(request, index)
                parent_hash = request.block_hashes[index - 1] if index else None
                if not self.pool.cache(block, request.block_hashes[index], key, parent, pins, parent_hash=parent_hash):
                    self._num_chained[request.request_id] = None
                    return
                for mm_hash in pins:
                    self._pinning.setdefault(mm_hash, set()).add(block)
                    if self.pin_listener is not None:
                        self.pin_listener.pin(mm_hash)
            self._num_chained[request.request_id] = index + 1

    def _items_pinned_by(self, request: Request, block_index: int) -> tuple[str, ...]:
        """Items a request hitting this block may still have to compute part of.

        A block ending strictly inside an item leaves the item's tail to compute. A block ending
        exactly at an item's end matters too: when the prompt ends there, a full hit recomputes
        the last token, which is one of the item's placeholders.
        """
        end = (block_index + 1) * self.block_size
        if self.pin_overlapping_items:
            return tuple(dict.fromkeys(item.mm_hash for item in request.mm_items if item.offset < end and item.end > end - self.block_size))
        return tuple(item.mm_hash for item in request.mm_items if item.offset < end <= item.end)

    def _on_evict(self, block: KVBlock) -> None:
        """An allocation takes a cached block: its KV goes to the host tier (with the pictures it pins)."""
        entry = self.host_tier.admit(block.block_hash, block.key, block.parent_hash, block.pins)
        if entry is not None:
            self._offloads.append(KVCopy(entry, block.block_id))

    def _on_uncache(self, block: KVBlock) -> None:
        if self.on_block_uncached is not None:
            self.on_block_uncached(block.block_hash)
        for mm_hash in block.pins:
            self._pinning[mm_hash].discard(block)
            if not self._pinning[mm_hash]:
                del self._pinning[mm_hash]
            if self.pin_listener is not None:
                self.pin_listener.unpin(mm_hash)

    def uncache_pinning(self, mm_hash: str) -> None:
        """Takes every cached block that pins this item out of the prefix cache (its holders keep it)."""
        for block in list(self._pinning.get(mm_hash, ())):
            self.pool.uncache(block)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so its tail is evicted before its head."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._req_block_ids.pop(request.request_id, None)
        self._num_chained.pop(request.request_id, None)
        self.pool.release(blocks[::-1])

    def free_past(self, request: Request, num_tokens: int) -> None:
        """Gives back the request's blocks past those that hold its first `num_tokens` tokens: blocks a verify
        step's rejected drafts, or a draft head's chain past the step, were given and its kept run did not reach
        (the next step takes again what it needs). They lie past every full block of the request, so none is
        cached or shared; they go to the head of the free queue, taken again before any cached block is evicted.
        The request's block-id list is replaced, not shortened: a step already launched keeps the table it read."""
        blocks = self._req_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        past = blocks[keep:]
        shared = [b.block_id for b in past if b.is_cached or b.ref_cnt != 1]
        if shared:
            raise RuntimeError(f"blocks {shared} of {request.request_id} past its {num_tokens} tokens are cached or shared")
        del blocks[keep:]
        self._req_block_ids[request.request_id] = self._req_block_ids[request.request_id][:keep]
        self.pool.release(past, evict_first=True)

    def hold_prefix(self, request: Request, prefix: Sequence[BlockHash]) -> list[KVBlock]:
        """References the request's first blocks once more when they are cached under exactly
        `prefix` (a prefix-sharing group keeps its shared blocks out of the free queue, so LRU
        cannot evict them); [] when they are not. `release_held` gives the references back."""
        blocks = self._req_blocks.get(request.request_id, [])[: len(prefix)]
        if len(blocks) < len(prefix) or any(b.block_hash != h for b, h in zip(blocks, prefix)):
            return []
        self.pool.touch(blocks)
        return blocks

    def release_held(self, blocks: list[KVBlock]) -> None:
        """Drops the references hold_prefix took; the blocks stay cached (tail evicted first)."""
        self.pool.release(blocks[::-1])

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block, in both tiers. Blocks in use stay with their requests, no longer shared."""
        self.pool.reset_cache()
        if self.host_tier is not None:
            self.host_tier.clear()
        for request_id in self._num_chained:
            self._num_chained[request_id] = None

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in order (a live list: read it, don't keep or change it)."""
        return self._req_block_ids.get(request_id, [])
