"""EncoderCacheManager: the books of the global encoder cache, keyed by mm_hash.

The tensors live with the runner; this side decides what is resident. An entry has one
reference per request occurrence that still needs it (request id, item index) and a pin count
(cached KV blocks that end inside its item, see kv_cache.manager). Unreferenced entries stay
resident and are evicted LRU, unpinned ones first, only when a committed allocation needs the
room. Dropping a pinned entry first asks the KV side to uncache the blocks that pin it.

`reset` (the tower's weights changed) evicts what no request references; an entry a running request
still references becomes stale: its holders keep reading it, but no other request is served it (`in`
says no), a request that needs the item encodes it again into the same entry (`allocate`), and once its
last holder lets go it is dropped at once, its output kept nowhere (`take_stale_freed`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

EncoderRef = tuple[str, int]  # (request id, item index)


@dataclass
class EncoderCacheEntry:
    mm_hash: str
    num_embeds: int
    refs: set[EncoderRef] = field(default_factory=set)
    pins: int = 0
    stale: bool = False  # made before the last reset: served to its holders only


class EncoderCacheManager:
    def __init__(self, capacity: int, uncache_pinning_blocks: Callable[[str], None] | None = None) -> None:
        self.capacity = capacity
        self.entries: dict[str, EncoderCacheEntry] = {}
        self.num_used = 0
        # Unreferenced resident entries, least recently released first.
        self._evictable_unpinned: OrderedDict[str, None] = OrderedDict()
        self._evictable_pinned: OrderedDict[str, None] = OrderedDict()
        self._num_evictable = 0  # embeddings held by unreferenced entries
        self._freed: list[str] = []
        self._stale_freed: list[str] = []  # freed entries whose outputs must not be kept (a host tier)
        self.uncache_pinning_blocks = uncache_pinning_blocks
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    def __contains__(self, mm_hash: str) -> bool:
        """Whether the item's output is resident and may be served to any request."""
        entry = self.entries.get(mm_hash)
        return entry is not None and not entry.stale

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins > 0)

    @property
    def num_referenced(self) -> int:
        return sum(1 for e in self.entries.values() if e.refs)

    def can_allocate(self, num_embeds: int, hits: Iterable[str] = ()) -> bool:
        """Whether num_embeds new embeddings fit once unreferenced entries are evicted, given that
        the resident entries in `hits` are about to be referenced (and so stop being evictable)."""
        held_by_hits = sum(self.entries[h].num_embeds for h in set(hits) if h in self.entries and not self.entries[h].refs)
        return self.num_used + num_embeds <= self.capacity + self._num_evictable - held_by_hits

    def add_reference(self, mm_hash: str, ref: EncoderRef) -> None:
        entry = self.entries[mm_hash]
        if not entry.refs:
            self._remove_evictable(entry)
        entry.refs.add(ref)

    def allocate(self, mm_hash: str, num_embeds: int, ref: EncoderRef) -> None:
        """Reserves room for a new entry (evicting if needed) and references it. A stale entry is taken
        over instead (its room is booked already): its old output is freed like an evicted one, and the
        item is encoded again, for its holders too."""
        stale = self.entries.get(mm_hash)
        if stale is not None:
            assert stale.stale and stale.num_embeds == num_embeds, stale
            stale.stale = False
            stale.refs.add(ref)
            self._freed.append(mm_hash)
            self._stale_freed.append(mm_hash)
            return
        while self.num_used + num_embeds > self.capacity:
            self._evict_one()
        self.entries[mm_hash] = EncoderCacheEntry(mm_hash, num_embeds, {ref})
        self.num_used += num_embeds

    def release(self, mm_hash: str, ref: EncoderRef) -> None:
        entry = self.entries[mm_hash]
        entry.refs.discard(ref)
        if entry.refs:
            return
        if entry.stale:
            self._drop_stale(entry)
        else:
            self._add_evictable(entry)

    def pin(self, mm_hash: str) -> None:
        entry = self.entries[mm_hash]
        if entry.pins == 0 and not entry.refs and not entry.stale:
            self._remove_evictable(entry)
            entry.pins += 1
            self._add_evictable(entry)
        else:
            entry.pins += 1

    def unpin(self, mm_hash: str) -> None:
        entry = self.entries[mm_hash]
        assert entry.pins > 0, entry
        if entry.pins == 1 and not entry.refs and not entry.stale:
            self._remove_evictable(entry)
            entry.pins = 0
            self._add_evictable(entry)
        else:
            entry.pins -= 1

    def drop(self, mm_hash: str) -> set[EncoderRef]:
        """Unbooks an entry whatever holds it (its output was never computed: the step that was to
        encode it failed) and returns the references it had; KV blocks pinning it are uncached first."""
        entry = self.entries[mm_hash]
        if entry.pins:
            assert self.uncache_pinning_blocks is not None
            self.uncache_pinning_blocks(mm_hash)
        if not entry.refs:
            self._remove_evictable(entry)
        del self.entries[mm_hash]
        self.num_used -= entry.num_embeds
        return entry.refs

    def take_freed(self) -> list[str]:
        """Entries evicted since the last call: the runner drops their tensors."""
        freed, self._freed = self._freed, []
        return freed

    def take_stale_freed(self) -> list[str]:
        """Those of the freed entries whose outputs are stale: the runner keeps no copy of them."""
        stale, self._stale_freed = self._stale_freed, []
        return stale

    def reset(self) -> None:
        """Evicts every unreferenced entry, pinned ones too (their KV blocks are uncached first); entries
        running requests reference become stale (module docstring), their pinning KV blocks uncached too."""
        while self._evictable_unpinned or self._evictable_pinned:
            self._evict_one()
        for entry in self.entries.values():
            entry.stale = True
            if entry.pins:
                assert self.uncache_pinning_blocks is not None
                self.uncache_pinning_blocks(entry.mm_hash)

    def _drop_stale(self, entry: EncoderCacheEntry) -> None:
        if entry.pins:
            assert self.uncache_pinning_blocks is not None
            self.uncache_pinning_blocks(entry.mm_hash)  # unpins it down to zero
        del self.entries[entry.mm_hash]
        self.num_used -= entry.num_embeds
        self._freed.append(entry.mm_hash)
        self._stale_freed.append(entry.mm_hash)

    # -- internals ----------------------------------------------------------------

    def _evict_one(self) -> None:
        if self._evictable_unpinned:
            mm_hash = next(iter(self._evictable_unpinned))
        elif self._evictable_pinned:
            mm_hash = next(iter(self._evictable_pinned))
            assert self.uncache_pinning_blocks is not None
            self.uncache_pinning_blocks(mm_hash)  # unpins it down to zero
        else:
            raise RuntimeError("encoder cache: nothing evictable (the scheduler must check can_allocate first)")
        entry = self.entries[mm_hash]
        assert not entry.refs and entry.pins == 0, entry
        self._remove_evictable(entry)
        del self.entries[mm_hash]
        self.num_used -= entry.num_embeds
        self._freed.append(mm_hash)
        self.num_evictions += 1

    def _queue(self, entry: EncoderCacheEntry) -> OrderedDict[str, None]:
        return self._evictable_pinned if entry.pins else self._evictable_unpinned

    def _add_evictable(self, entry: EncoderCacheEntry) -> None:
        self._queue(entry)[entry.mm_hash] = None
        self._num_evictable += entry.num_embeds

    def _remove_evictable(self, entry: EncoderCacheEntry) -> None:
        del self._queue(entry)[entry.mm_hash]
        self._num_evictable -= entry.num_embeds
