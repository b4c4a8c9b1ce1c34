"""The recurrent-state books alone (kv_cache/recurrent_state.py): where checkpoints are taken, when they
become visible, which one a hit resumes from, and that every slot is accounted for."""

from __future__ import annotations

from helpers import make_request
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.coordinator import CacheCoordinator
from mmengine.kv_cache.manager import KVCacheManager
from mmengine.kv_cache.recurrent_state import RecurrentStateManager, StatePlan

BS = 4


def _books(num_checkpoints: int = 8) -> tuple[KVCacheManager, RecurrentStateManager]:
    kv = KVCacheManager(64, BS, make_hash_function("xxh3_128", 0))
    states = RecurrentStateManager(2, num_checkpoints, BS, is_block_cached=kv.pool.is_hash_cached)
    kv.on_block_uncached = states.drop
    return kv, states


def _run_chunk(kv: KVCacheManager, states: RecurrentStateManager, request, start: int, num_new: int, admit_from: int | None = None):
    """What the scheduler does for one chunk: plan, allocate, then book it as computed."""
    plan = states.admit(request, admit_from) if admit_from is not None else None
    if plan is None:
        from mmengine.kv_cache.recurrent_state import StatePlan

        plan = StatePlan(states.live_slot(request.request_id))
    states.plan_saves(request, plan, start, num_new)
    kv.allocate(request, num_new, [], start)
    request.num_computed_tokens = start + num_new
    kv.cache_blocks(request)
    states.commit(request)
    return plan


def test_a_prompt_leaves_its_prompt_point_and_its_trailing_checkpoint():
    kv, states = _books()
    request = make_request("a", 10)  # prompt point (10 - 1) // 4 * 4 = 8; the chunk ends at 10: trailing 8 too
    kv.hash_new_blocks(request)
    plan = _run_chunk(kv, states, request, 0, 10, admit_from=0)
    assert plan.reset and [position for position, _ in plan.saves] == [8]
    twin = make_request("b", 10)
    kv.hash_new_blocks(twin)
    assert states.resume_point(twin, 2, twin.num_tokens - 1) == 2  # a repeat resumes at 8: two blocks recomputed at most
    states.audit()


def test_the_trailing_checkpoint_moves_on_and_the_prompt_point_stays():
    kv, states = _books()
    request = make_request("a", 6, max_tokens=20)  # prompt point 4
    kv.hash_new_blocks(request)
    _run_chunk(kv, states, request, 0, 6, admit_from=0)
    for token in range(100, 110):  # decode: the live state passes 8 and 12 (and 16 when the token at 15 is computed)
        request.append_output_token(token)
        kv.hash_new_blocks(request)
        _run_chunk(kv, states, request, request.num_computed_tokens, 1)
    cached = [k for k in range(1, 5) if request.block_hashes[k - 1] in states._checkpoints]
    assert cached == [1, 4]  # the prompt's at 4, the trailing one at 16 (8 and 12 were dropped as it moved)
    states.release(request)
    kv.free(request)
    assert states.num_cached_checkpoints == 2 and states.live_slot("a") is None
    states.audit()


def test_a_checkpoint_dies_with_the_block_it_marks():
    kv, states = _books()
    request = make_request("a", 10)
    kv.hash_new_blocks(request)
    _run_chunk(kv, states, request, 0, 10, admit_from=0)
    states.release(request)
    kv.free(request)
    assert states.num_cached_checkpoints == 1
    kv.reset_prefix_cache()  # every block leaves the cache
    assert states.num_cached_checkpoints == 0
    states.audit()


def test_checkpoints_are_evicted_least_recently_used_first():
    kv, states = _books(num_checkpoints=2)
    requests = [make_request(name, 6, tokens=[10 * i + t for t in range(6)]) for i, name in enumerate("abc")]
    for request in requests:
        kv.hash_new_blocks(request)
        _run_chunk(kv, states, request, 0, 6, admit_from=0)
        states.release(request)
        kv.free(request)
    assert states.checkpoints_evicted == 1
    assert [states.resume_point(r, 1, 5) for r in requests] == [0, 1, 1]
    states.audit()


def test_a_save_not_yet_computed_is_never_registered():
    """A step that fails (its tokens never booked) leaves nothing visible; release frees its slots."""
    kv, states = _books()
    request = make_request("a", 10)
    kv.hash_new_blocks(request)
    plan = states.admit(request, 0)
    states.plan_saves(request, plan, 0, 10)
    kv.allocate(request, 10, [], 0)
    states.commit(request)  # the step failed: num_computed_tokens is still 0
    assert states.num_cached_checkpoints == 0
    states.release(request)
    kv.free(request)
    states.audit()
    assert len(states._free_checkpoints) == states.num_checkpoints


def test_a_reset_forgets_running_requests_saves_and_they_save_nothing_more():
    """A weight update mid-step: a save booked before the reset, computed after it, must never register,
    even once another request (on the new weights) caches the block it marks; nor may a later save of a
    request that was running at the reset. Otherwise the next prompt resumes from a state of the old weights."""
    kv, states = _books()
    caches = CacheCoordinator(kv, states, BS)
    stale = make_request("a", 10, max_tokens=8)  # prompt point 8
    kv.hash_new_blocks(stale)
    plan = states.admit(stale, 0)
    states.plan_saves(stale, plan, 0, 10)
    kv.allocate(stale, 10, [], 0)
    assert [position for position, _ in plan.saves] == [8]
    caches.reset_prefix_cache()  # the step is in flight; its tokens are booked after
    stale.num_computed_tokens = 10
    caches.booked(stale)
    stale.append_output_token(99)
    kv.hash_new_blocks(stale)
    later = StatePlan(states.live_slot("a"))
    states.plan_saves(stale, later, 10, 6)  # passes 12 and 16: no save for a state from before the reset
    assert later.saves == []
    fresh = make_request("b", 14, tokens=list(range(1, 11)) + [99, 5, 6, 7])  # shares a's first 10 tokens
    kv.hash_new_blocks(fresh)
    _run_chunk(kv, states, fresh, 0, 14, admit_from=0)  # caches blocks 0-2; saves at 12 only
    caches.booked(stale)  # a's old save at 8 would register now: block 1 is cached (by b)
    probe = make_request("c", 10)
    kv.hash_new_blocks(probe)
    assert states.resume_point(probe, 2, 9) == 0  # nothing at 8: no checkpoint of the old weights
    states.release(stale)
    kv.free(stale)
    states.audit()
