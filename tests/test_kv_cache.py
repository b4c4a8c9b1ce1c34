"""Block pool and KV cache manager: reference counts, free-queue order, paired can_allocate/allocate."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import make_request
from mmengine.kv_cache.block_pool import BlockPool
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.manager import KVCacheManager

HASH = make_hash_function("xxh3_128", 0)


def test_pool_takes_oldest_free_blocks_and_requeues_released_ones_last():
    pool = BlockPool(4)
    a = pool.take(2)
    assert [b.block_id for b in a] == [0, 1] and all(b.ref_cnt == 1 for b in a)
    pool.release([a[1], a[0]])
    assert [b.block_id for b in pool.take(4)] == [2, 3, 1, 0]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.take(1)


def test_manager_grows_a_request_block_by_block():
    kv = KVCacheManager(4, 4, HASH)
    req = make_request("a", 6)
    assert kv.blocks_needed(req, 6) == 2
    kv.allocate(req, 6)
    req.num_computed_tokens = 6
    assert kv.blocks_needed(req, 2) == 0  # tokens 6 and 7 still fit in block 1
    assert kv.blocks_needed(req, 3) == 1
    assert kv.can_allocate(req, 10) and not kv.can_allocate(req, 11)
    kv.allocate(req, 3)
    assert kv.block_ids("a") == [0, 1, 2] and kv.num_free_blocks == 1


def test_free_releases_tail_first():
    kv = KVCacheManager(3, 2, HASH)
    req = make_request("a", 6)
    kv.allocate(req, 6)
    kv.free(req)
    other = make_request("b", 2)
    kv.allocate(other, 2)
    assert kv.block_ids("b") == [2]  # the freed tail block is reused first
    assert kv.block_ids("a") == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9), st.booleans()), min_size=1, max_size=60))
def test_random_allocate_and_free_keep_books_consistent(ops):
    kv = KVCacheManager(12, 4, HASH)
    requests = {}
    for slot, tokens, free in ops:
        rid = f"r{slot}"
        req = requests.setdefault(rid, make_request(rid, 1))
        if free:
            kv.free(req)
            req.num_computed_tokens = 0
        elif kv.can_allocate(req, tokens):
            before = kv.num_free_blocks
            needed = kv.blocks_needed(req, tokens)
            kv.allocate(req, tokens)
            req.num_computed_tokens += tokens
            assert kv.num_free_blocks == before - needed
            assert len(kv.block_ids(rid)) * 4 >= req.num_computed_tokens
        held = [b for r in requests for b in kv.block_ids(r)]
        assert len(held) == len(set(held))
        assert len(held) + kv.num_free_blocks == 12
        assert all(kv.pool.blocks[b].ref_cnt == 1 for b in held)
    for req in requests.values():
        kv.free(req)
    assert kv.num_free_blocks == 12 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
