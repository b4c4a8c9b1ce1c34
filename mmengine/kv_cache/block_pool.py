"""BlockPool: the KV cache's physical blocks, reference counts, the free queue and the prefix cache.

A block whose KV is complete can be cached under its chained hash. When its last user
releases it, it joins the free queue but keeps its hash and contents: a later request
with the same prefix can take it back out (a hit) until the block is reallocated, which
evicts it. The free queue is LRU: the head is evicted first. It is an OrderedDict keyed
by block id, so taking a hit block out of the middle is O(1), like appending and popping.

A cached block is reachable only through its parent (a lookup walks the chain from block 0),
so taking a block out of the cache takes its cached descendants out too: they could never be
hit again, and would otherwise hold their hashes (keeping a recomputed chain from being cached)
and their pins on encoder outputs until LRU reached them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mmengine.kv_cache.block_hash import BlockHash, BlockKey


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    key: BlockKey | None = None
    # Identity of this caching of the block, and of its parent's: a lookup must match the
    # parent it actually walked through, so a parent that was evicted and re-cached with other
    # contents can never make a stale child look valid.
    cache_id: int | None = None
    parent_cache_id: int | None = None
    # mm_hashes of the items whose placeholder run this cached block ends inside: their
    # encoder outputs must stay resident while the block is cached.
    pins: tuple[str, ...] = ()
    parent_hash: BlockHash | None = None  # the hash of the block before it (the host tier verifies it)

    @property
    def is_cached(self) -> bool:
        return self.cache_id is not None


class BlockPool:
    def __init__(self, num_blocks: int, on_uncache: Callable[[KVBlock], None] | None = None,
                 on_evict: Callable[[KVBlock], None] | None = None, empty_first: bool = False) -> None:
        """`empty_first`: free blocks that cache nothing are taken before any cached one is evicted (they
        wait in a queue of their own), whatever the order they were freed in."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._empty: OrderedDict[int, KVBlock] | None = None
        if empty_first:
            self._empty, self._free = self._free, OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}
        self._children: dict[int, set[KVBlock]] = {}  # cache_id -> cached blocks chained after it
        self._cache_ids = itertools.count()
        self.num_evictions = 0
        self.on_uncache = on_uncache  # called whenever a block leaves the prefix cache
        self.on_evict = on_evict  # called, before on_uncache, for each block an allocation evicts (its KV still there)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + (len(self._empty) if self._empty is not None else 0)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # -- prefix cache ---------------------------------------------------------

    def is_hash_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def lookup(self, block_hash: BlockHash, key: BlockKey, parent_cache_id: int | None) -> KVBlock | None:
        """The cached block with exactly this content after exactly this parent, else None."""
        block = self._cached.get(block_hash)
        if block is None or block.key != key or block.parent_cache_id != parent_cache_id:
            return None
        return block

    def cache(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        key: BlockKey,
        parent_cache_id: int | None,
        pins: tuple[str, ...] = (),
        parent_hash: BlockHash | None = None,
    ) -> bool:
        """Registers a block whose KV is complete. False if another block already holds this hash."""
        assert not block.is_cached and block.ref_cnt > 0, block
        if block_hash in self._cached:
            return False
        block.block_hash, block.key, block.parent_cache_id, block.pins = block_hash, key, parent_cache_id, pins
        block.parent_hash = parent_hash
        block.cache_id = next(self._cache_ids)
        self._cached[block_hash] = block
        if parent_cache_id is not None:
            self._children.setdefault(parent_cache_id, set()).add(block)
        return True

    def uncache(self, block: KVBlock, evicting: bool = False) -> None:
        """Takes a block and its cached descendants out of the prefix cache; whoever holds them keeps them.
        `evicting`: an allocation takes the block (on_evict hears of each block first)."""
        if not block.is_cached:
            return
        siblings = self._children.get(block.parent_cache_id)
        if siblings is not None:
            siblings.discard(block)
            if not siblings:
                del self._children[block.parent_cache_id]
        stack = [block]
        while stack:
            current = stack.pop()
            stack.extend(self._children.pop(current.cache_id, ()))
            del self._cached[current.block_hash]
            if evicting and self.on_evict is not None:
                self.on_evict(current)
            self._forget(current)

    def reset_cache(self) -> None:
        for block in list(self._cached.values()):
            self.uncache(block)

    def _forget(self, block: KVBlock) -> None:
        if self.on_uncache is not None:
            self.on_uncache(block)
        block.block_hash = block.key = block.cache_id = block.parent_cache_id = block.parent_hash = None
        block.pins = ()

    # -- allocation -----------------------------------------------------------

    def take(self, n: int) -> list[KVBlock]:
        """Takes the n least recently freed blocks (evicting cached ones) and references them once."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        taken = []
        for _ in range(n):
            _, block = (self._empty or self._free).popitem(last=False)
            assert block.ref_cnt == 0, block
            if block.is_cached:
                self.uncache(block, evicting=True)
                self.num_evictions += 1
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVBlock]) -> None:
        """References cached blocks a request reuses, taking free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if self._free.pop(block.block_id, None) is None:
                    del self._empty[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock], evict_first: bool = False) -> None:
        """Drops one reference from each block; blocks reaching zero join the queue in the given order, at
        its tail (evicted last) or, with `evict_first`, at its head (the first of them evicted first)."""
        for block in reversed(blocks) if evict_first else blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self._empty is not None and not block.is_cached:
                    self._empty[block.block_id] = block
                    continue
                self._free[block.block_id] = block
                if evict_first:
                    self._free.move_to_end(block.block_id, last=False)


class PoolBacked:
    """A manager whose blocks are one BlockPool's (`self.pool`): the counts it reports are the pool's."""

    pool: BlockPool

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
