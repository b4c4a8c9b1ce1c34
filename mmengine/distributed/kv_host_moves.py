"""The prefix cache's host tier at tensor_parallel_size > 1: the driver's books (`kv_cache/host_tier.py`, unchanged)
decide which blocks go to host memory and come back; each rank copies its own KV heads' slice of those blocks to
and from host buffers of its own, with the runner's copy (`ModelRunner.copy_kv_blocks`), before the step's forward.

```
driver: KVCacheManager.take_copies -> ParallelRunner.copy_kv_blocks -> DriverHostBlocks.book: a key per entry
        the next StepPlan carries KVMoves(offloads, restores, dropped)
rank:   RankHostBlocks.apply: offloads (device -> host), then restores (host -> device), then drops
```

An entry is named by a key of its own (not its block hash, which a later entry may reuse). The driver's tier
drops entries without telling anyone (LRU, `forget`, `clear`): a rank drops its copy when the driver's entry object
is gone (a finalizer), with the next plan.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

from mmengine.kv_cache.host_tier import HostBlock, KVCopy


@dataclass
class KVMoves:
    """One plan's copies between the tiers, in this order: offloads, restores, then host copies to drop."""

    offloads: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host key)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host key)
    dropped: list[int] = field(default_factory=list)  # host keys the driver's tier no longer holds


@dataclass(frozen=True)
class RemoteKV:
    """What a driver's HostBlock holds in place of its tensors: the key the ranks keep them under."""

    key: int


class DriverHostBlocks:
    """The driver's side: keys for the tier's entries, and the moves for the next plan."""

    def __init__(self) -> None:
        self.keys = itertools.count()
        self.moves = KVMoves()
        self.dropped: list[int] = []  # appended by finalizers (list.append is atomic)

    def book(self, offloads: list[KVCopy], restores: list[KVCopy]) -> None:
        """Books the copies the scheduler took for the next plan; they count as queued (`done`), as the ranks
        receive every plan in order and copy before the forward."""
        for copy in offloads:
            key = next(self.keys)
            copy.entry.kv = RemoteKV(key)  # type: ignore[assignment]  (the tier's lookup needs it set)
            weakref.finalize(copy.entry, self.dropped.append, key)
            self.moves.offloads.append((copy.block_id, key))
            copy.done = True
        for copy in restores:
            self.moves.restores.append((copy.block_id, copy.entry.kv.key))  # type: ignore[union-attr]
            copy.done = True

    def take(self) -> KVMoves | None:
        dropped = self.dropped[:]
        del self.dropped[: len(dropped)]  # (the same list: the finalizers hold it)
        moves, self.moves = self.moves, KVMoves()
        moves.dropped = dropped
        return moves if moves.offloads or moves.restores or moves.dropped else None


class RankHostBlocks:
    """A rank's host copies of its heads' slice of the blocks the driver's tier holds, by key."""

    def __init__(self) -> None:
        self.entries: dict[int, HostBlock] = {}

    def apply(self, runner, moves: KVMoves) -> None:  # noqa: ANN001 - a ModelRunner (runner/ imports distributed/)
        offloads = []
        for block_id, key in moves.offloads:
            self.entries[key] = HostBlock(key, (), None)  # (the books are the driver's: only the tensors matter here)
            offloads.append(KVCopy(self.entries[key], block_id))
        restores = [KVCopy(self.entries[key], block_id, restore=True) for block_id, key in moves.restores]
        runner.copy_kv_blocks(offloads, restores)
        for key in moves.dropped:
            self.entries.pop(key, None)
