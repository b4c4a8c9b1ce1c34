"""A full audit of an engine's books: the KV cache and encoder cache managers against each other,
against the scheduler's requests, and against the runner's tensors. Used after every step of the
randomized workloads; any disagreement is an AssertionError naming it."""

from __future__ import annotations

from collections import Counter

from mmengine import MMEngine
from mmengine.kv_cache.manager import cdiv


def assert_books_consistent(engine: MMEngine) -> None:
    _check_kv_blocks(engine)
    _check_window_blocks(engine)
    _check_encoder_entries(engine)
    _check_requests(engine)
    _check_recurrent_states(engine)


def _check_kv_blocks(engine: MMEngine) -> None:
    kv, pool, scheduler = engine.kv_cache, engine.kv_cache.pool, engine.scheduler
    holders = Counter(block.block_id for blocks in kv._req_blocks.values() for block in blocks)
    holders.update(block.block_id for block in scheduler.sharing.held_blocks())  # prefix-sharing groups' holds
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}: ref_cnt {block.ref_cnt}, held {holders[block.block_id]}x"
        assert (block.block_id in pool._free) == (block.ref_cnt == 0), f"block {block.block_id} free queue membership"
    assert set(kv._req_blocks) == {r.request_id for r in scheduler.running}, "only running requests hold blocks"
    for block_hash, block in pool._cached.items():
        assert block.is_cached and block.block_hash == block_hash, f"cached block {block.block_id} under a wrong hash"
    cached = set(pool._cached.values())
    for block in pool.blocks:
        assert block.is_cached == (block in cached), f"block {block.block_id} cache flag"
    pinning = {h: set(blocks) for h, blocks in kv._pinning.items()}
    expected: dict[str, set] = {}
    for block in cached:
        for mm_hash in block.pins:
            expected.setdefault(mm_hash, set()).add(block)
    assert pinning == expected, "pin index disagrees with the cached blocks' pins"


def _check_window_blocks(engine: MMEngine) -> None:
    """Sliding-window models: the window pool's references are the running requests' live window blocks
    and the groups' holds; every request keeps every block its later queries can still read."""
    windows, scheduler = engine.scheduler.caches.windows, engine.scheduler
    if windows is None:
        return
    pool, null = windows.pool, windows.null_block
    holders = Counter(b.block_id for blocks in windows._req_blocks.values() for b in blocks if b is not null)
    holders.update(b.block_id for group in scheduler.sharing.groups for b in group.window_held)
    assert null.ref_cnt == 1 and null.block_id not in pool._free and not null.is_cached, "the null block"
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], f"window block {block.block_id}: ref_cnt {block.ref_cnt}, held {holders[block.block_id]}x"
        free = block.block_id in pool._free or block.block_id in pool._empty
        assert free == (block.ref_cnt == 0), f"window block {block.block_id} free queue membership"
        assert block.block_id not in pool._empty or not block.is_cached, f"window block {block.block_id} cached in the empty queue"
    assert set(windows._req_blocks) == {r.request_id for r in scheduler.running}, "only running requests hold window blocks"
    for block_hash, block in pool._cached.items():
        assert block.is_cached and block.block_hash == block_hash, f"cached window block {block.block_id} under a wrong hash"
    for request in scheduler.running:
        blocks, ids = windows._req_blocks[request.request_id], windows.block_ids(request.request_id)
        assert [b.block_id for b in blocks] == ids, f"{request}: window block ids disagree with its blocks"
        live = range(windows.first_needed_block(request.num_computed_tokens), cdiv(request.num_computed_tokens, windows.block_size))
        assert all(blocks[i] is not null for i in live), f"{request} lost a window block it can still read"


def _check_encoder_entries(engine: MMEngine) -> None:
    cache, runner, scheduler, kv = engine.encoder_cache, engine.runner, engine.scheduler, engine.kv_cache
    # Entries freed since the last schedule (a stale entry whose last holder released it as its step was booked):
    # the runner drops their tensors first thing in the next step
    pending = set(cache._freed) - set(cache.entries)
    outputs = set(runner.encoder_outputs) - pending
    assert set(cache.entries) == outputs, (
        f"booked without tensor: {set(cache.entries) - outputs}, tensor without booking: {outputs - set(cache.entries)}"
    )
    for mm_hash, entry in cache.entries.items():
        assert runner.encoder_outputs[mm_hash].shape[0] == entry.num_embeds, f"{mm_hash}: tensor rows != num_embeds"
        assert entry.pins == len(kv._pinning.get(mm_hash, ())), f"{mm_hash}: {entry.pins} pins, {len(kv._pinning.get(mm_hash, ()))} blocks"
    assert set(kv._pinning) <= set(cache.entries), "a cached KV block pins an entry that is gone"
    assert cache.num_used == sum(e.num_embeds for e in cache.entries.values()) <= cache.capacity
    refs = {h: set() for h in cache.entries}
    for request_id, held in scheduler._held.items():
        request = scheduler.requests[request_id]
        for idx in held:
            refs.setdefault(request.mm_items[idx].mm_hash, set()).add((request_id, idx))
    assert {h: e.refs for h, e in cache.entries.items()} == refs, "entry references disagree with what requests hold"
    assert all(e.refs for e in cache.entries.values() if e.stale), "a stale encoder entry outlived its last holder"
    unpinned = [h for h, e in cache.entries.items() if not e.refs and not e.pins]
    pinned = [h for h, e in cache.entries.items() if not e.refs and e.pins]
    assert set(cache._evictable_unpinned) == set(unpinned) and set(cache._evictable_pinned) == set(pinned), "evictable queues"
    assert cache._num_evictable == sum(cache.entries[h].num_embeds for h in unpinned + pinned), "evictable count"


def _check_requests(engine: MMEngine) -> None:
    scheduler, kv = engine.scheduler, engine.kv_cache
    assert {r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting} == set(scheduler.requests)
    assert set(scheduler._held) <= {r.request_id for r in scheduler.running}, "a waiting request holds encoder references"
    for request in scheduler.running:
        blocks = kv._req_blocks.get(request.request_id, [])
        assert len(blocks) >= cdiv(request.num_computed_tokens, kv.block_size), f"{request} lost blocks"
        held = scheduler._held.get(request.request_id, set())
        for idx, item in enumerate(request.mm_items):
            if item.offset < request.num_computed_tokens < item.end:  # half-computed: the rest needs the embeddings
                assert idx in held and item.mm_hash in engine.runner.encoder_outputs, f"{request} item {idx} lost"


def _check_recurrent_states(engine: MMEngine) -> None:
    """Hybrid models: every state slot is free, live, a checkpoint or a booked save, exactly once; the
    running requests are exactly the live ones; every checkpoint marks a block the KV cache holds."""
    states = engine.scheduler.states
    if states is None:
        return
    states.audit()
    assert set(states._live) == {r.request_id for r in engine.scheduler.running}, "live state slots != running requests"
    for block_hash in states._checkpoints:
        assert engine.kv_cache.pool.is_hash_cached(block_hash), "a checkpoint outlived the block it marks"
