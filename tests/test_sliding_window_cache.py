"""The sliding-window layers' block pool (kv_cache/sliding_window.py) and the coordinator's hits over it:
blocks that left the window go back to the pool (the table keeps the null block), stay cached until
reallocated, and a prefix hit holds only where the window before its end is found."""

from __future__ import annotations

from helpers import make_request
from window_runs import find_hit, run_prompt
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.coordinator import CacheCoordinator
from mmengine.kv_cache.manager import KVCacheManager
from mmengine.kv_cache.sliding_window import NULL_BLOCK_ID, SlidingWindowManager

HASH = make_hash_function("xxh3_128", 0)
BS, WINDOW = 4, 6


def _coordinator(full_blocks: int = 32, window_blocks: int = 8) -> CacheCoordinator:
    return CacheCoordinator(KVCacheManager(full_blocks, BS, HASH), None, BS, SlidingWindowManager(window_blocks, BS, WINDOW))


def test_blocks_that_left_the_window_go_back_to_the_pool():
    caches = _coordinator()
    windows = caches.windows
    request = make_request("a", 30)
    run_prompt(caches, request, chunk=4)
    # 30 tokens computed: later queries see keys from 30 - 6 + 1 = 25 on, in block 6 (and block 7 holds 28, 29)
    table = windows.block_ids("a")
    assert table[:6] == [NULL_BLOCK_ID] * 6 and NULL_BLOCK_ID not in table[6:]
    assert windows.num_held_blocks("a") == 2
    assert windows.num_freed_out_of_window == 6
    assert caches.kv_cache.block_ids("a") == list(range(8))  # the full layers keep every block
    # A pool of 8 (the null block and 7) served a request of 8 blocks: a window never needs more than 4 at once
    assert windows.num_free_blocks == 8 - 1 - 2


def test_a_request_never_holds_more_than_its_window_and_chunk():
    caches = _coordinator(window_blocks=1 + 4)  # the null block and cdiv(6 - 1 + 4, 4) + 1 = 4
    request = make_request("a", 40)
    run_prompt(caches, request, chunk=4)
    assert caches.windows.num_held_blocks("a") <= 4 and request.num_computed_tokens == 40


def test_a_hit_needs_the_window_before_its_end():
    caches = _coordinator()
    first = make_request("a", 24)
    run_prompt(caches, first, chunk=8)
    window = caches.windows.block_ids("a")[4:6]
    chain = list(caches.kv_cache.block_ids("a"))
    caches.release(first)
    # The same prompt again: its full chain (6 blocks) is cached, and so is every window block (freed, not evicted)
    again = make_request("b", 24)
    run = run_prompt(caches, again, chunk=8)
    assert run.hit.num_hit_blocks == 6 and run.hit.num_computed == 23
    # the last token (23) is recomputed: it sees keys from 18 on, blocks 4 and 5
    assert [b.block_id for b in run.hit.window_hits] == window
    # and the hit is taken: a's blocks (its chain; its window after null blocks), and one token computed
    assert run.full_block_ids == chain and run.window_block_ids == [NULL_BLOCK_ID] * 4 + window
    assert run.num_prefilled == 1


def test_evicted_window_blocks_shorten_the_hit_to_where_a_window_is_found():
    caches = _coordinator(window_blocks=12)
    windows = caches.windows
    first = make_request("a", 32, tokens=list(range(1, 33)))
    run_prompt(caches, first, chunk=4)
    chain = list(caches.kv_cache.block_ids("a"))
    caches.release(first)
    again = make_request("b", 32, tokens=list(range(1, 33)))
    assert find_hit(caches, again).num_hit_blocks == 8
    for index in (6, 7):  # evicted (as an allocation would)
        windows.pool.uncache(next(blk for blk in windows.pool.blocks if blk.block_hash == again.block_hashes[index]))
    assert len(caches.kv_cache.get_computed_blocks(again)) == 8  # the full layers still have the whole chain
    hit = caches.find_hit(again, False, lambda _: False)
    # 8 and 7 blocks need block 6; 6 blocks (24 tokens) need keys from 19 on: blocks 4 and 5
    assert hit.num_hit_blocks == 6 and hit.num_computed == 24 and len(hit.hits) == 6
    assert [b.block_hash for b in hit.window_hits] == again.block_hashes[4:6]
    run = run_prompt(caches, again, chunk=8)
    assert run.hit.num_hit_blocks == 6 and run.num_prefilled == 8
    assert run.full_block_ids[:6] == chain[:6]
    assert run.window_block_ids[:6] == [NULL_BLOCK_ID] * 4 + [b.block_id for b in hit.window_hits]


def test_a_pool_reused_by_another_prompt_leaves_no_hit():
    caches = _coordinator(window_blocks=6)
    first = make_request("a", 32, tokens=list(range(1, 33)))
    run_prompt(caches, first, chunk=4)
    caches.release(first)
    filler = make_request("f", 20, tokens=list(range(100, 120)))  # takes all 5 usable window blocks at once
    run_prompt(caches, filler, chunk=20)
    caches.release(filler)
    again = make_request("b", 32, tokens=list(range(1, 33)))
    caches.kv_cache.hash_new_blocks(again)
    assert len(caches.kv_cache.get_computed_blocks(again)) == 8
    assert caches.find_hit(again, False, lambda _: False).num_hit_blocks == 0


def test_a_window_block_is_verified_by_its_parent_hash():
    """Window blocks have no chain in their pool: a lookup checks each one's key and parent's hash."""
    caches = _coordinator()
    a = make_request("a", 16, tokens=list(range(1, 17)))
    run_prompt(caches, a, chunk=16)
    caches.release(a)
    b = make_request("b", 17, tokens=list(range(1, 18)))
    assert find_hit(caches, b).num_hit_blocks == 4
    last = next(blk for blk in caches.windows.pool.blocks if blk.block_hash == b.block_hashes[3])
    last.parent_hash = b"another parent"
    assert caches.find_hit(b, False, lambda _: False).num_hit_blocks == 3  # the hits that do not need block 3
    run = run_prompt(caches, b, chunk=16)
    assert run.hit.num_hit_blocks == 3 and run.num_prefilled == 17 - 12


def test_freeing_a_request_returns_every_block_but_the_null_one():
    caches = _coordinator()
    request = make_request("a", 21)
    run_prompt(caches, request, chunk=5)
    caches.release(request)
    assert caches.windows.num_free_blocks == caches.windows.num_blocks - 1
    assert caches.kv_cache.num_free_blocks == caches.kv_cache.num_blocks


def _cached_hashes(windows: SlidingWindowManager) -> set[bytes]:
    return {blk.block_hash for blk in windows.pool.blocks if blk.is_cached}


def test_blocks_that_left_the_window_are_evicted_before_a_finished_prompts_end():
    """A long request streams blocks out of its window; they go first, so an earlier prompt's last blocks
    (what its repetition or its next turn needs) outlive them, and that prompt is still a hit."""
    caches = _coordinator(window_blocks=8)
    windows = caches.windows
    first = make_request("a", 16, tokens=list(range(1, 17)))
    run_prompt(caches, first, chunk=16)
    caches.release(first)
    long = make_request("long", 64, tokens=list(range(200, 264)))
    run_prompt(caches, long, chunk=4)  # 16 blocks through a pool of 7: it reuses its own freed blocks
    assert windows.pool.num_evictions > 0
    caches.release(long)
    again = make_request("b", 17, tokens=list(range(1, 18)))
    run = run_prompt(caches, again, chunk=4)
    assert run.hit.num_hit_blocks == 4 and run.num_prefilled == 1


def test_a_window_that_served_a_hit_is_kept_like_a_prompts_end():
    """Blocks taken as a hit's window (a shared prefix's end) go to the tail of the queue when they leave
    the window again, not to the head."""
    caches = _coordinator(window_blocks=12)
    windows = caches.windows
    shared = list(range(1, 17))
    first = make_request("a", 24, tokens=[*shared, *range(50, 58)])
    run_prompt(caches, first, chunk=4)
    caches.release(first)
    second = make_request("b", 24, tokens=[*shared, *range(60, 68)])
    run = run_prompt(caches, second, chunk=8)
    assert run.hit.num_hit_blocks == 4 and run.num_prefilled == 8
    served = {b.block_hash for b in run.hit.window_hits}
    assert run.window_block_ids[:4] == [NULL_BLOCK_ID] * 2 + [b.block_id for b in run.hit.window_hits]  # keys from 11 on
    caches.release(second)
    # 7 blocks at once: the 3 never used, then 4 evicted: the 2 that a's run left behind and a's end
    third = make_request("c", 28, tokens=list(range(300, 328)))
    run_prompt(caches, third, chunk=28)
    assert windows.pool.num_evictions == 4 and served <= _cached_hashes(windows)


def test_empty_blocks_are_taken_before_cached_ones_are_evicted():
    caches = _coordinator(window_blocks=12)
    windows = caches.windows
    first = make_request("a", 24)
    run_prompt(caches, first, chunk=24)
    caches.release(first)
    cached = _cached_hashes(windows)
    assert len(cached) == 6 and windows.num_free_blocks == 11
    other = make_request("b", 20, tokens=list(range(100, 120)))
    run_prompt(caches, other, chunk=20)  # 5 blocks: the pool's 5 never-used ones
    assert windows.pool.num_evictions == 0 and cached <= _cached_hashes(windows)


def test_a_held_window_outlives_the_churn_that_evicts_the_rest():
    """A prefix-sharing group's hold: the window before the shared prefix's end (blocks a request freed
    mid-run, first in line for eviction) stays cached while the group runs, so its members still hit."""
    caches = _coordinator(window_blocks=8)
    windows = caches.windows
    a = make_request("a", 24, tokens=list(range(1, 25)))
    run_prompt(caches, a, chunk=4)
    held = windows.hold_window(a, 3)  # the shared prefix: 12 tokens; its hit needs keys from 7 on, blocks 1 and 2
    assert [b.block_hash for b in held] == a.block_hashes[1:3]
    caches.release(a)
    churn = make_request("c", 40, tokens=list(range(300, 340)))
    run_prompt(caches, churn, chunk=4)
    caches.release(churn)
    member = make_request("m", 20, tokens=[*range(1, 13), *range(500, 508)])
    run = run_prompt(caches, member, chunk=8)
    assert run.hit.num_hit_blocks == 3 and run.num_prefilled == 8
    assert run.window_block_ids[:3] == [NULL_BLOCK_ID, *(b.block_id for b in held)]
    caches.release(member)
    windows.release_held(held)
    assert all(b.ref_cnt == 0 for b in held)


def test_a_request_running_across_a_reset_caches_no_more_window_blocks():
    """After a weight update the window blocks a running request computes hold KV from before it: they
    must not be cached, or a later request would take them as the window of its hit."""
    caches = _coordinator()
    request = make_request("a", 30)
    caches.allocate(request, 12, find_hit(caches, request), 0)
    request.num_computed_tokens = 12
    caches.booked(request)
    assert _cached_hashes(caches.windows)
    caches.reset_prefix_cache()
    assert not _cached_hashes(caches.windows)
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(4, request.num_tokens - request.num_computed_tokens)
        caches.allocate(request, num_new, None, None)
        request.num_computed_tokens += num_new
        caches.booked(request)
    assert not _cached_hashes(caches.windows) and caches.kv_cache.num_cached_blocks == 0
    caches.release(request)
    again = make_request("b", 30)
    assert run_prompt(caches, again, chunk=4).num_prefilled == 30  # no hit: a request made after the reset caches as usual
    assert _cached_hashes(caches.windows)
