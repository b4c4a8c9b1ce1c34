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
        """Room for a block the device evicts (LRU out); None when the tier has no room at all or holds it."""
        if self.capacity_blocks <= 0 or block_hash in self._entries:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
            return None
        while len(self._entries) >= self.capacity_blocks:
            self._entries.popitem(last=False)
            self.num_evictions += 1
        entry = HostBlock(block_hash, key, parent_hash, tuple(pins))
        self._entries[block_hash] = entry
        self.num_stored += 1
        return entry

    def forget(self, entry: HostBlock) -> None:
        if self._entries.get(entry.block_hash) is entry:
            del self._entries[entry.block_hash]

    def touch(self, entry: HostBlock) -> None:
        self._entries.move_to_end(entry.block_hash)
        self.num_hits += 1

    def clear(self) -> None:
        self._entries.clear()
