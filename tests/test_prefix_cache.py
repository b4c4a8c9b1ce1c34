"""Prefix cache books: verified hits, LRU eviction (tail first), hit blocks in the free queue, consistency."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import make_request
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.manager import KVCacheManager

BS = 4
HASH = make_hash_function("xxh3_128", 0)


def manager(num_blocks=16, hash_fn=HASH, enabled=True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, hash_fn, enable_prefix_caching=enabled)


def compute(kv: KVCacheManager, request, num_tokens=None) -> None:
    """Admits (with hits) and computes the request's prompt, caching its full blocks."""
    kv.hash_new_blocks(request)
    hits = kv.get_computed_blocks(request)
    computed = min(len(hits) * BS, request.num_tokens - 1) if hits else 0
    new = (num_tokens or request.num_tokens) - computed
    kv.allocate(request, new, hits, computed)
    request.num_computed_tokens = computed + new
    kv.cache_blocks(request)


def test_a_finished_prefix_is_reused_until_evicted():
    kv = manager(num_blocks=6)
    first = make_request("a", 10)
    compute(kv, first)
    assert kv.num_cached_blocks == 2
    kv.free(first)
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 2  # free but still cached

    second = make_request("b", 11, tokens=list(range(1, 9)) + [50, 51, 52])
    kv.hash_new_blocks(second)
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 2 and all(b.ref_cnt == 0 for b in hits)
    # both hits sit in the free queue, so they use up free capacity when reused
    assert kv.blocks_needed(second, 3, hits, 8) == 1 + 2
    kv.allocate(second, 3, hits, 8)
    assert kv.num_free_blocks == 3 and all(b.ref_cnt == 1 for b in hits)


def test_shared_blocks_are_reference_counted():
    kv = manager()
    a, b = make_request("a", 9), make_request("b", 9)
    compute(kv, a)
    compute(kv, b)
    probe = make_request("c", 9)
    kv.hash_new_blocks(probe)
    shared = kv.get_computed_blocks(probe)
    assert len(shared) == 2 and all(block.ref_cnt == 2 for block in shared)
    kv.free(a)
    assert all(block.ref_cnt == 1 for block in shared)
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_colliding_hash_never_gives_a_wrong_hit():
    def collide(data: bytes) -> bytes:  # every block hashes to one of two values
        return bytes([data[-1] & 1]) * 16

    kv = manager(hash_fn=collide)
    a = make_request("a", 12, tokens=list(range(12)))
    compute(kv, a)
    kv.free(a)
    for tokens in ([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], list(range(100, 112))):
        other = make_request("x", 12, tokens=tokens)
        kv.hash_new_blocks(other)
        hits = kv.get_computed_blocks(other)
        for i, block in enumerate(hits):
            assert block.key.token_ids == tuple(tokens[i * BS : (i + 1) * BS])
    same = make_request("y", 12, tokens=list(range(12)))
    kv.hash_new_blocks(same)
    assert len(kv.get_computed_blocks(same)) >= 1  # the exact same prefix still hits


def test_a_child_matches_only_after_the_exact_parent_it_was_cached_after():
    from mmengine.kv_cache.block_hash import BlockKey
    from mmengine.kv_cache.block_pool import BlockPool

    pool = BlockPool(2)
    parent, child = pool.take(2)
    child_key = BlockKey((2, 2), ())
    assert pool.cache(parent, b"P", BlockKey((1, 1), ()), None)
    assert pool.cache(child, b"C", child_key, parent.cache_id)
    assert pool.lookup(b"C", child_key, parent.cache_id) is child
    assert pool.lookup(b"C", child_key, parent.cache_id + 1) is None
    assert pool.lookup(b"C", child_key, None) is None


def test_evicting_a_parent_uncaches_its_descendants_so_the_chain_can_be_cached_again():
    """A child cached under parent P can never be hit once P is evicted (lookups walk the chain), so it
    leaves the cache with P: it must not keep its hash, which would stop the recomputed chain from being
    cached, nor its pins. Its holder keeps it; siblings under other parents are untouched."""
    from mmengine.kv_cache.block_hash import BlockKey
    from mmengine.kv_cache.block_pool import BlockPool

    uncached = []
    pool = BlockPool(5, on_uncache=lambda block: uncached.append(block.block_id))
    parent, child, grandchild, other_root, other_child = pool.take(5)
    key = BlockKey((1, 1), ())
    assert pool.cache(parent, b"P", key, None)
    assert pool.cache(child, b"C", key, parent.cache_id)
    assert pool.cache(grandchild, b"G", key, child.cache_id)
    assert pool.cache(other_root, b"Q", key, None)
    assert pool.cache(other_child, b"D", key, other_root.cache_id)
    pool.release([parent, other_root, other_child])  # the child and grandchild are still in use
    (reused,) = pool.take(1)  # evicts the parent, the head of the free queue
    assert reused is parent
    assert sorted(uncached) == [parent.block_id, child.block_id, grandchild.block_id]
    assert not child.is_cached and not grandchild.is_cached and child.ref_cnt == 1
    assert other_root.is_cached and other_child.is_cached and pool.num_cached_blocks == 2
    # The same contents recomputed after a newly cached parent take the freed hashes.
    assert pool.cache(reused, b"P", key, None)
    assert pool.cache(child, b"C", key, reused.cache_id)


def test_eviction_is_lru_and_tail_first():
    kv = manager(num_blocks=4)
    a = make_request("a", 8, tokens=list(range(8)))
    compute(kv, a)
    kv.free(a)
    head, tail = kv.pool.blocks[0], kv.pool.blocks[1]
    assert head.is_cached and tail.is_cached
    kv.allocate(make_request("n", 12, tokens=list(range(50, 62))), 12)  # needs 3 of the 4 blocks
    assert head.is_cached and not tail.is_cached  # the tail went before the head
    assert kv.pool.num_evictions == 1


def test_disabled_prefix_caching_never_hits():
    kv = manager(enabled=False)
    a = make_request("a", 9)
    compute(kv, a)
    kv.free(a)
    assert kv.num_cached_blocks == 0
    b = make_request("b", 9)
    kv.hash_new_blocks(b)
    assert kv.get_computed_blocks(b) == []


def test_reset_forgets_cached_blocks():
    kv = manager()
    a = make_request("a", 9)
    compute(kv, a)
    kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 0 and not any(b.is_cached for b in kv.pool.blocks)
    b = make_request("b", 9)
    kv.hash_new_blocks(b)
    assert kv.get_computed_blocks(b) == []


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 14), st.booleans()), min_size=1, max_size=50))
def test_random_operations_keep_the_books_consistent(ops):
    """Random admit / grow / free over a few shared prefixes: counts, queue and table always agree."""
    kv = manager(num_blocks=10)
    live: dict[str, object] = {}
    prefixes = [list(range(p * 100, p * 100 + 14)) for p in range(4)]
    for slot, prefix, length, free in ops:
        rid = f"r{slot}"
        if rid in live and free:
            kv.free(live.pop(rid))
        elif rid not in live:
            request = make_request(rid, length, tokens=prefixes[prefix][:length])
            kv.hash_new_blocks(request)
            hits = kv.get_computed_blocks(request)
            computed = min(len(hits) * BS, length - 1) if hits else 0
            if kv.can_allocate(request, length - computed, hits, computed):
                kv.allocate(request, length - computed, hits, computed)
                request.num_computed_tokens = length
                kv.cache_blocks(request)
                live[rid] = request
        _check_consistency(kv, live)
    for request in live.values():
        kv.free(request)
    assert kv.num_free_blocks == 10 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def _check_consistency(kv: KVCacheManager, live: dict) -> None:
    refs = {}
    for rid in live:
        for block_id in kv.block_ids(rid):
            refs[block_id] = refs.get(block_id, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0)
        assert (block.block_id in kv.pool._free) == (block.ref_cnt == 0)
        if block.is_cached:
            assert kv.pool._cached[block.block_hash] is block
    assert len(kv.pool._cached) == sum(b.is_cached for b in kv.pool.blocks)
    for rid, request in live.items():  # every held block's contents are what the request expects
        for i, block_id in enumerate(kv.block_ids(rid)):
            block = kv.pool.blocks[block_id]
            if block.is_cached:
                assert block.key.token_ids == tuple(request.all_token_ids[i * BS : (i + 1) * BS])
