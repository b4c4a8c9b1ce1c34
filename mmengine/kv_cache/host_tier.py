"""The prefix cache's host tier: full KV blocks evicted from the device keep their KV in (pinned) host
memory, with their verified hash, token key and parent hash, LRU by bytes. A request whose prefix
continues past its device hits into the host tier gets those blocks back by a copy into fresh device
blocks, queued in the step that reads them: admission counts them as computed (a copy, not a prefill).

A block that pins an encoder output (a picture ends inside it) keeps its pins here and comes back only
while that output is resident or in the encoder's host tier (the scheduler books it back with the
block), so the invariant "a cached KV block never needs its image re-encoded" holds across both tiers.
The manager keeps the books (what to copy where); the runner moves the tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mmengine.kv_cache.block_hash import BlockHash, BlockKey


@dataclass
class HostBlock:
    block_hash: BlockHash
    key: BlockKey
    parent_hash: BlockHash | None
    pins: tuple[str, ...] = ()  # pictures this block ends inside: restorable only while their outputs can be had
    # per layer shape (runner/kv_tensors.py) [layers, 2, block_size, kv_heads, head_dim], set once the copy is queued
    kv: list[torch.Tensor] | None = None
    # on a GPU, recorded after the queued device-to-host copy: `kv` may be read on the host once it is done
    copied: torch.cuda.Event | None = None


@dataclass(eq=False)
class KVCopy:
    """One block's copy between the tiers: device block `block_id` to `entry` or, with `restore`, back."""

    entry: HostBlock
    block_id: int
    restore: bool = False
    done: bool = False  # queued on the device


class KVHostTier:
    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self.capacity_blocks = capacity_bytes // block_bytes if block_bytes else 0
        self.block_bytes = block_bytes
        self._entries: OrderedDict[BlockHash, HostBlock] = OrderedDict()
        # Entries an allocation is restoring right now: never the LRU victim of the device evictions that
        # same allocation causes (taking fresh blocks for them may evict cached blocks, chains and all)
        self._held: set[BlockHash] = set()
        self.num_hits = 0  # blocks copied back instead of prefilled
        self.num_stored = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return len(self._entries) * self.block_bytes

    def lookup(self, block_hash: BlockHash, key: BlockKey, parent_hash: BlockHash | None) -> HostBlock | None:
        entry = self._entries.get(block_hash)
        if entry is None or entry.key != key or entry.parent_hash != parent_hash or entry.kv is None:
            return None
        return entry

    def admit(self, block_hash: BlockHash, key: BlockKey, parent_hash: BlockHash | None,
              pins: tuple[str, ...] = ()) -> HostBlock | None:
        """Room for a block the device evicts (LRU out, never an entry being restored); None when the tier
        holds it already or has no room (none at all, or every entry is being restored)."""
        if self.capacity_blocks <= 0 or block_hash in self._entries:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
            return None
        while len(self._entries) >= self.capacity_blocks:
            victim = next((h for h in self._entries if h not in self._held), None)  # held ones sit at the MRU end
            if victim is None:  # every entry is being restored: no room for this block
                return None
            del self._entries[victim]
            self.num_evictions += 1
        entry = HostBlock(block_hash, key, parent_hash, tuple(pins))
        self._entries[block_hash] = entry
        self.num_stored += 1
        return entry

    def holds(self, entry: HostBlock) -> bool:
        """Whether the tier still keeps this very entry (not evicted, not replaced)."""
        return self._entries.get(entry.block_hash) is entry

    def forget(self, entry: HostBlock) -> None:
        if self.holds(entry):
            del self._entries[entry.block_hash]

    @contextmanager
    def restoring(self, entries: Sequence[HostBlock]) -> Iterator[None]:
        """Host hits being copied back: counted and made most recently used, then kept from LRU eviction
        while the block allocation that restores them runs (its device evictions come here)."""
        assert all(self.holds(entry) for entry in entries), "a host hit left the tier before its restore"
        for entry in entries:
            self._entries.move_to_end(entry.block_hash)
            self.num_hits += 1
        self._held.update(entry.block_hash for entry in entries)
        try:
            yield
        finally:
            self._held.clear()

    def clear(self) -> None:
        self._entries.clear()
