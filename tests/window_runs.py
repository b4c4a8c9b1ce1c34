"""A CacheCoordinator driven as the scheduler drives it, for the window pools' tests (sliding windows,
attention chunks): a request's prompt computed in prefill chunks from its prefix hit, and the hit a new
request finds."""

from __future__ import annotations

from mmengine.core.request import Request
from mmengine.kv_cache.coordinator import CacheCoordinator, PrefixHit


def find_hit(caches: CacheCoordinator, request: Request) -> PrefixHit:
    """The prefix hit of a request just arrived: its blocks hashed, no host blocks pinned."""
    caches.kv_cache.hash_new_blocks(request)
    return caches.find_hit(request, False, lambda _: False)


def run_prompt(caches: CacheCoordinator, request: Request, chunk: int) -> None:
    """Admits the request and computes its prompt in prefill chunks of `chunk` tokens, as the scheduler books them."""
    hit = find_hit(caches, request)
    request.num_computed_tokens = hit.num_computed
    request.num_prefix_hit_tokens = hit.num_hit_blocks * caches.block_size
    first = True
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert caches.can_allocate(request, num_new, hit if first else None, request.num_computed_tokens if first else None)
        caches.allocate(request, num_new, hit if first else None, request.num_computed_tokens if first else None)
        first = False
        request.num_computed_tokens += num_new
        caches.booked(request)
