"""The chunked-attention layers' block pool (kv_cache/chunked_attention.py: the window pool's books with the chunk's
rule) and the coordinator's hits over it: a request keeps the blocks from its current chunk's start only, and a
prefix hit needs only the cached blocks of the chunk holding its end."""

from __future__ import annotations

from helpers import make_request
from window_runs import run_prompt
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.chunked_attention import AttentionChunk, ChunkedAttentionManager, chunk_start, is_chunk
from mmengine.kv_cache.coordinator import CacheCoordinator
from mmengine.kv_cache.manager import KVCacheManager
from mmengine.kv_cache.sliding_window import NULL_BLOCK_ID

HASH = make_hash_function("xxh3_128", 0)
BS, CHUNK = 4, 16


def _coordinator(full_blocks: int = 32, chunk_blocks: int = 10) -> CacheCoordinator:
    return CacheCoordinator(KVCacheManager(full_blocks, BS, HASH), None, BS, ChunkedAttentionManager(chunk_blocks, BS, CHUNK))


def test_an_attention_chunk_is_a_span_of_its_own_kind():
    chunk = AttentionChunk(16)
    assert chunk == 16 and f"{chunk}" == "16" and is_chunk(chunk) and not is_chunk(16) and not is_chunk(None)
    assert [chunk_start(p, 16) for p in (0, 15, 16, 31, 33)] == [0, 0, 16, 16, 32]
    assert len({chunk, AttentionChunk(16)}) == 1 and len({chunk, 16}) == 2


def test_blocks_before_the_current_chunk_go_back_to_the_pool():
    caches = _coordinator()
    chunks = caches.windows
    request = make_request("a", 38)
    run_prompt(caches, request, chunk=4)
    # 38 tokens computed: later queries (38 on) see keys from 32 on, block 8 (and block 9 holds 36, 37)
    table = chunks.block_ids("a")
    assert table[:8] == [NULL_BLOCK_ID] * 8 and NULL_BLOCK_ID not in table[8:]
    assert chunks.num_held_blocks("a") == 2 and chunks.num_freed_out_of_window == 8
    assert caches.kv_cache.block_ids("a") == list(range(10))  # the full layers keep every block


def test_a_request_never_holds_more_than_its_chunk_and_a_prefill_chunk():
    caches = _coordinator(chunk_blocks=1 + 6)  # the null block and what a request may hold: cdiv(16 - 1 + 8, 4) + 1
    request = make_request("a", 64)
    held = []
    caches.kv_cache.hash_new_blocks(request)
    while request.num_computed_tokens < request.num_tokens:
        assert caches.can_allocate(request, 8)
        caches.allocate(request, 8)
        held.append(caches.windows.num_held_blocks("a"))
        request.num_computed_tokens += 8
        caches.booked(request)
    assert max(held) <= 6 and request.num_computed_tokens == 64


def test_a_hit_needs_only_the_blocks_of_the_chunk_holding_its_end():
    caches = _coordinator()
    first = make_request("a", 40)
    run_prompt(caches, first, chunk=8)
    chunk_blocks = caches.windows.block_ids("a")[8:]
    chain = list(caches.kv_cache.block_ids("a"))
    caches.release(first)
    again = make_request("b", 40)
    run = run_prompt(caches, again, chunk=8)
    # the full chain: 10 blocks; the last token (39) is recomputed and sees keys from 32 on: blocks 8 and 9
    assert run.hit.num_hit_blocks == 10 and run.hit.num_computed == 39
    assert [b.block_id for b in run.hit.window_hits] == chunk_blocks
    # admitted, the request reads a's blocks (its table holds the null block before the chunk) and computes one token
    assert run.window_block_ids == [NULL_BLOCK_ID] * 8 + chunk_blocks and run.full_block_ids == chain
    assert run.num_prefilled == 1 and caches.windows.num_held_blocks("b") == 2


def test_the_smallest_pool_keeps_whole_hits():
    """A pool of the null block and five (a chunk and a prefill chunk of 4): the chunk holding a hit's end needs two
    blocks (keys from 32 on for the recomputed token 39), which the pool still has cached after the request left."""
    caches = _coordinator(chunk_blocks=1 + 5)
    first = make_request("a", 40)
    run_prompt(caches, first, chunk=4)
    chunk_blocks = caches.windows.block_ids("a")[8:]
    caches.release(first)
    again = make_request("b", 40)
    run = run_prompt(caches, again, chunk=4)
    assert run.hit.num_hit_blocks == 10 and run.hit.num_computed == 39
    assert run.window_block_ids == [NULL_BLOCK_ID] * 8 + chunk_blocks and run.num_prefilled == 1
