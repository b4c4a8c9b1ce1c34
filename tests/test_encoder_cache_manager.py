"""Encoder cache books: references per occurrence, LRU eviction on commit, pinning, dropping pinned entries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import make_request, make_scheduler
from mmengine.encoder_cache.manager import EncoderCacheManager
from mmengine.core.scheduler import Scheduler

EOS = frozenset({0})


def test_references_count_occurrences_and_entries_stay_resident():
    cache = EncoderCacheManager(capacity=10)
    cache.allocate("a", 4, ("r1", 0))
    cache.add_reference("a", ("r1", 2))  # the same image twice in one request
    cache.release("a", ("r1", 0))
    assert cache.entries["a"].refs == {("r1", 2)}
    cache.release("a", ("r1", 2))
    assert "a" in cache and cache.take_freed() == []  # unreferenced but resident


def test_a_reset_leaves_referenced_entries_to_their_holders_alone():
    """After a reset (the tower's weights changed) an entry a running request still reads is stale: its
    holders keep it, nobody else is served it, a request that needs the item encodes it again into the same
    entry (the old output freed), and a stale entry whose last holder lets go is dropped at once, kept nowhere."""
    uncached = []
    cache = EncoderCacheManager(capacity=20, uncache_pinning_blocks=lambda h: (uncached.append(h), cache.unpin(h)))
    cache.allocate("free", 4, ("r0", 0))
    cache.release("free", ("r0", 0))
    cache.allocate("read", 4, ("r1", 0))
    cache.pin("read")  # a cached KV block of r1's (computed from the old output) ends inside it
    cache.allocate("done", 4, ("r2", 0))
    cache.reset()
    assert cache.take_freed() == ["free"] and cache.take_stale_freed() == []
    assert uncached == ["read"] and cache.entries["read"].pins == 0  # its KV block left the prefix cache
    assert "read" not in cache and "done" not in cache and set(cache.entries) == {"read", "done"}
    cache.allocate("read", 4, ("r3", 0))  # a new request encodes it again, into the same entry
    assert "read" in cache and cache.entries["read"].refs == {("r1", 0), ("r3", 0)}
    assert cache.take_freed() == ["read"] and cache.take_stale_freed() == ["read"]  # the old output goes
    cache.release("done", ("r2", 0))
    assert "done" not in cache.entries and cache.num_used == 4
    assert cache.take_freed() == ["done"] and cache.take_stale_freed() == ["done"]
    assert not cache._evictable_unpinned and not cache._evictable_pinned


def test_eviction_is_lru_only_on_allocate_and_unpinned_first():
    uncached = []
    cache = EncoderCacheManager(capacity=10, uncache_pinning_blocks=lambda h: (uncached.append(h), cache.unpin(h)))
    for name, ref in (("a", "r1"), ("b", "r2"), ("c", "r3")):
        cache.allocate(name, 3, (ref, 0))
    cache.pin("a")
    for name, ref in (("a", "r1"), ("b", "r2"), ("c", "r3")):
        cache.release(name, (ref, 0))
    assert cache.can_allocate(10) and not cache.can_allocate(11)
    assert cache.take_freed() == []  # asking evicts nothing
    cache.allocate("d", 4, ("r4", 0))  # needs 3 more: b is the oldest unpinned
    assert cache.take_freed() == ["b"] and uncached == []
    cache.allocate("e", 6, ("r5", 0))  # c, then the pinned a (its KV blocks uncached first)
    assert cache.take_freed() == ["c", "a"] and uncached == ["a"]
    assert cache.num_evictions == 3 and cache.num_used == 10


def test_can_allocate_counts_hits_that_stop_being_evictable():
    cache = EncoderCacheManager(capacity=8)
    cache.allocate("a", 4, ("r1", 0))
    cache.release("a", ("r1", 0))
    assert cache.can_allocate(8)
    assert not cache.can_allocate(8, hits=["a"])  # a will be referenced, so it cannot make room
    assert cache.can_allocate(4, hits=["a"])


def test_referenced_entries_are_never_evicted():
    cache = EncoderCacheManager(capacity=8)
    cache.allocate("a", 4, ("r1", 0))
    assert not cache.can_allocate(5)
    with pytest.raises(RuntimeError):
        cache.allocate("b", 5, ("r2", 0))


def test_reset_drops_unreferenced_entries_only():
    cache = EncoderCacheManager(capacity=10, uncache_pinning_blocks=lambda h: cache.unpin(h))
    cache.allocate("a", 3, ("r1", 0))
    cache.allocate("b", 3, ("r2", 0))
    cache.pin("b")
    cache.release("b", ("r2", 0))
    cache.reset()
    assert set(cache.entries) == {"a"} and cache.take_freed() == ["b"]


def _run_step(sched: Scheduler):
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: 3 for s in out.scheduled if s.samples}, EOS)
    return out


def _check_pinning_invariant(sched: Scheduler) -> None:
    """Every cached KV block ending inside an item (or at its end) has that item's entry resident."""
    for block in sched.kv_cache.pool.blocks:
        if block.is_cached:
            for mm_hash in block.pins:
                entry = sched.encoder_cache.entries[mm_hash]
                assert entry.pins > 0
    pins = {}
    for block in sched.kv_cache.pool.blocks:
        for mm_hash in block.pins if block.is_cached else ():
            pins[mm_hash] = pins.get(mm_hash, 0) + 1
    assert {h: e.pins for h, e in sched.encoder_cache.entries.items() if e.pins} == pins
    assert sched.encoder_cache.num_used <= sched.encoder_cache.capacity


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 4), st.integers(0, 2)), min_size=1, max_size=14),
    st.integers(6, 40),
    st.sampled_from([6, 8, 12]),
)
def test_random_workloads_keep_pins_and_references_consistent(specs, budget, encoder_capacity):
    """Shared prefixes and images under a tiny encoder cache and KV cache: no deadlock, invariants hold."""
    sched = make_scheduler(
        num_blocks=24, block_size=4, encoder_capacity=encoder_capacity, encoder_budget=6,
        max_num_batched_tokens=budget, max_num_seqs=3,
    )
    requests = []
    for i, (prefix, image, max_tokens, position) in enumerate(specs):
        tokens = [100 + prefix] * (2 + 3 * position) + [0] * 6 + [200 + i] * 3
        offset = 2 + 3 * position
        requests.append(make_request(f"r{i}", len(tokens), max_tokens=max_tokens, tokens=tokens,
                                     images=[(offset, 6)], image_hashes=[f"img{image}"], ignore_eos=True))
    pending = list(requests)
    for _ in range(3000):
        if pending:
            sched.add_request(pending.pop(0))
        elif not sched.has_unfinished_requests():
            break
        out = _run_step(sched)
        assert not out.is_empty or not sched.has_unfinished_requests() or pending
        _check_pinning_invariant(sched)
    assert not sched.has_unfinished_requests() and not pending
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)
    assert sched.encoder_cache.num_referenced == 0
    assert sched.kv_cache.num_free_blocks == 24
    assert sched.num_reencodes_after_prefix_hit == 0


def test_pinning_keeps_the_item_a_full_hit_recomputes():
    """A prompt ending with its image at a block boundary: a later identical request gets a full hit and
    recomputes the last token, an image placeholder. Pressure in between evicts unpinned entries only,
    so the item is still there and is not encoded again."""
    sched = make_scheduler(num_blocks=16, block_size=4, encoder_capacity=6, encoder_budget=4)

    def run(request):
        sched.add_request(request)
        while sched.has_unfinished_requests():
            _run_step(sched)

    tokens = [5, 5, 5, 5, 0, 0, 0, 0]
    run(make_request("a", 8, max_tokens=1, tokens=tokens, images=[(4, 4)], image_hashes=["X"]))
    assert sched.encoder_cache.entries["X"].pins == 1
    run(make_request("b", 3, max_tokens=1, tokens=[7, 0, 0], images=[(1, 2)], image_hashes=["Y"]))
    run(make_request("c", 3, max_tokens=1, tokens=[8, 0, 0], images=[(1, 2)], image_hashes=["Z"]))
    assert "X" in sched.encoder_cache and "Y" not in sched.encoder_cache  # the unpinned one went
    again = make_request("d", 8, max_tokens=1, tokens=tokens, images=[(4, 4)], image_hashes=["X"])
    run(again)
    assert again.num_cached_tokens == 7
    assert sched.encoder_cache.num_misses == 3 and sched.num_reencodes_after_prefix_hit == 0
