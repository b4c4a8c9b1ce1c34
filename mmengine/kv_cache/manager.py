"""KVCacheManager: which blocks each request holds, and whether more can be had."""

from __future__ import annotations

from mmengine.kv_cache.block_pool import BlockPool, KVBlock
from mmengine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so the request can hold its computed tokens plus num_new_tokens."""
        held = len(self._req_blocks.get(request.request_id, ()))
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - held)

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.pool.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        needed = self.blocks_needed(request, num_new_tokens)
        self._req_blocks.setdefault(request.request_id, []).extend(self.pool.take(needed))

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so its tail is reused before its head."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self.pool.release(blocks[::-1])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]
