"""BlockPool: the KV cache's physical blocks, their reference counts and the free queue."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Owns every block. Free blocks sit in an LRU-ordered queue (oldest first).

    The queue is an OrderedDict keyed by block id so that taking a block out of the
    middle (a cached block being reused) is O(1), like appending and popping.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[KVBlock]:
        """Takes the n least recently freed blocks and references them once."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, only {len(self._free)} free")
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def release(self, blocks: list[KVBlock]) -> None:
        """Drops one reference from each block; blocks reaching zero join the queue in the given order."""
        for block in blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
