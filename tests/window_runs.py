"""A CacheCoordinator driven as the scheduler drives it, for the window pools' tests (sliding windows,
attention chunks): a request's prompt computed in prefill chunks from its prefix hit, and the hit a new
request finds. `run_prompt` says what the run reused and computed, so that a test of a hit can check the hit
was taken (not only found)."""

from __future__ import annotations

from dataclasses import dataclass

from mmengine.core.request import Request
from mmengine.kv_cache.coordinator import CacheCoordinator, PrefixHit


@dataclass
class PromptRun:
    """What admitting a request and computing its prompt took."""

    hit: PrefixHit  # the hit it was admitted with
    full_block_ids: list[int]  # its full-attention blocks once admitted: the hit's blocks first
    window_block_ids: list[int]  # its window-pool table once admitted: null blocks, then the hit's window
    num_prefilled: int  # prompt tokens computed in prefill chunks (the rest came from the hit)
    num_chunks: int


def find_hit(caches: CacheCoordinator, request: Request) -> PrefixHit:
    """The prefix hit of a request just arrived: its blocks hashed, no host blocks pinned."""
    caches.kv_cache.hash_new_blocks(request)
    return caches.find_hit(request, False, lambda _: False)


def run_prompt(caches: CacheCoordinator, request: Request, chunk: int) -> PromptRun:
    """Admits the request and computes its prompt in prefill chunks of `chunk` tokens, as the scheduler books them."""
    hit = find_hit(caches, request)
    caches.kv_cache.record_lookup(request.num_tokens, hit.num_computed)
    request.num_computed_tokens = hit.num_computed
    request.num_prefix_hit_tokens = hit.num_hit_blocks * caches.block_size
    run = PromptRun(hit, [], [], 0, 0)
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        first = run.num_chunks == 0
        admitted = hit if first else None
        start = request.num_computed_tokens if first else None
        assert caches.can_allocate(request, num_new, admitted, start)
        caches.allocate(request, num_new, admitted, start)
        if first:
            run.full_block_ids = list(caches.kv_cache.block_ids(request.request_id))
            run.window_block_ids = list(caches.windows.block_ids(request.request_id)) if caches.windows is not None else []
        run.num_chunks += 1
        run.num_prefilled += num_new
        request.num_computed_tokens += num_new
        caches.booked(request)
    return run
