"""The encoder cache's host tier at tensor_parallel_size > 1: the driver's tier (`encoder_cache/host_tier.py`, fed
tensors on the meta device of each output's size, so its LRU by bytes, hits and counters are TP 1's) decides; every
rank keeps its own copy of the outputs the driver's tier holds (the encoders are replicated) and brings them back
where the plan's rows say.

```
driver: free -> tier.store(meta)          a row's restored item -> tier.load (LRU, hits)
        the next plan: EncoderHostMoves(keep: outputs the ranks copy to host as they free them,
                                        dropped: copies the driver's tier no longer holds)
rank:   RankEncoderHostTier: the plan's frees (keeping those named), the step's restores, then the drops
```
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from mmengine.encoder_cache.host_tier import EncoderHostTier

META = torch.device("meta")


@dataclass
class EncoderHostMoves:
    keep: list[str] = field(default_factory=list)  # outputs freed with this plan that go to host memory
    dropped: list[str] = field(default_factory=list)  # host copies to drop (the driver's tier evicted or cleared them)


class DriverEncoderHost:
    """The driver's books over its tier: what the ranks hold in host memory, and each output's size."""

    def __init__(self, tier: EncoderHostTier, embedding_bytes: int) -> None:
        self.tier = tier
        self.embedding_bytes = embedding_bytes
        self.sizes: dict[str, int] = {}  # mm_hash -> bytes of each output the ranks hold on the device
        self.ranks_hold: set[str] = set()  # outputs the ranks hold in host memory
        self.freed: list[str] = []  # freed (not stale) since the last plan

    def encoded(self, mm_hash: str, num_embeddings: int) -> None:
        self.sizes[mm_hash] = num_embeddings * self.embedding_bytes

    def restore(self, mm_hash: str, num_embeddings: int) -> None:
        """A row brings the output back (as the runner's `tier.load` at TP 1: most recently used, a hit)."""
        self.tier.load(mm_hash, META)
        self.encoded(mm_hash, num_embeddings)

    def free(self, mm_hashes: list[str], stale: list[str]) -> None:
        """The device evicts these: the tier keeps those not stale (as the runner's `free_encoder_outputs`)."""
        for mm_hash in mm_hashes:
            size = self.sizes.pop(mm_hash, None)
            if size is not None and mm_hash not in stale:
                self.tier.store(mm_hash, torch.empty(size, dtype=torch.uint8, device=META))
                self.freed.append(mm_hash)

    def take(self) -> EncoderHostMoves | None:
        dropped = [mm_hash for mm_hash in self.ranks_hold if not self.tier.holds(mm_hash)]
        self.ranks_hold.difference_update(dropped)
        keep = [mm_hash for mm_hash in dict.fromkeys(self.freed) if self.tier.holds(mm_hash) and mm_hash not in self.ranks_hold]
        self.ranks_hold.update(keep)
        self.freed = []
        return EncoderHostMoves(keep, dropped) if keep or dropped else None


class RankEncoderHostTier(EncoderHostTier):
    """A rank's host copies: stores only what the plan names, drops what it names, never decides on its own."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=sys.maxsize)
        self.keep: set[str] = set()  # the plan's: what its frees store

    def drop_all(self, mm_hashes: list[str]) -> None:
        """After the step's restores: the driver's tier may have evicted an output this very step brings back."""
        for mm_hash in mm_hashes:
            self.drop(mm_hash)

    def store(self, mm_hash: str, output: torch.Tensor) -> None:
        if mm_hash in self.keep:
            super().store(mm_hash, output)
