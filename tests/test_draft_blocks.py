"""Blocks taken for drafts go back once the step that verified them is booked: a verify step's rejected drafts and a
draft head's chain past the step (DraftPlanner.take_draft_blocks) hold blocks only while a step in flight may still
write them, so a request whose drafts are rejected never keeps more blocks than its tokens and its running row need:
in the full-attention pool and in a windowed model's sliding-window pool, and for a row launched ahead only as far
as its own chain reaches (the head stores no further)."""

from __future__ import annotations

import pytest

from books import assert_books_consistent
from helpers import make_request
from mmengine import MMEngine, SamplingParams
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.manager import KVCacheManager, cdiv
from mmengine.kv_cache.sliding_window import NULL_BLOCK_ID, SlidingWindowManager
from mmengine.testing.mtp import tiny_qwen3_5_mtp_path

BLOCK = 4
K = 3
HASH = make_hash_function("xxh3_128", 0)


def test_free_past_gives_back_the_tail_first_in_line_and_leaves_launched_tables_alone():
    kv = KVCacheManager(8, BLOCK, HASH)
    request = make_request("r", 6)
    kv.allocate(request, 6 + 7)  # 13 tokens: 4 blocks, the last two past the request's 6 tokens + 1
    launched = kv.block_ids("r")  # a step launched with this table keeps it as it was
    before = list(launched)
    kv.free_past(request, 7)
    assert kv.block_ids("r") == before[:2] and launched == before
    assert kv.num_free_blocks == 6
    assert kv.pool.take(2) == [kv.pool.blocks[i] for i in before[2:]]  # taken again before any other block
    kv.free_past(request, 8)  # nothing past 8 tokens: no change
    assert kv.block_ids("r") == before[:2]


def test_free_past_refuses_a_block_someone_else_holds():
    kv = KVCacheManager(8, BLOCK, HASH)
    request = make_request("r", 6)
    kv.allocate(request, 10)
    kv.pool.touch([kv._req_blocks["r"][-1]])
    with pytest.raises(RuntimeError, match="cached or shared"):
        kv.free_past(request, 6)


def test_window_free_past_gives_back_the_tail_and_leaves_launched_tables_alone():
    windows = SlidingWindowManager(8, BLOCK, window=8)
    request = make_request("r", 6)
    windows.allocate(request, 6 + 7)  # 13 tokens: 4 blocks, the last two past the request's 6 tokens + 1
    launched = windows.block_ids("r")
    before = list(launched)
    free = windows.num_free_blocks
    windows.free_past(request, 7)
    assert windows.block_ids("r") == before[:2] and launched == before
    assert windows.num_free_blocks == free + 2 and windows.num_held_blocks("r") == 2
    assert set(before[2:]) <= set(windows.pool._empty)  # uncached: taken before any cached block is evicted
    windows.free_past(request, 8)
    assert windows.block_ids("r") == before[:2]


def test_window_free_past_refuses_a_block_someone_else_holds():
    windows = SlidingWindowManager(8, BLOCK, window=8)
    request = make_request("r", 6)
    windows.allocate(request, 10)
    windows.pool.touch([windows._req_blocks["r"][-1]])
    with pytest.raises(RuntimeError, match="cached or shared"):
        windows.free_past(request, 6)
    assert NULL_BLOCK_ID not in windows.block_ids("r")


def _in_flight_end(engine: MMEngine, request) -> tuple[int, int | None]:
    """(the end of the request's row in the step in flight, 0 without one; that step's draft depths)."""
    in_flight = engine.steps.in_flight
    if in_flight is None:
        return 0, None
    for row in in_flight.out.scheduled:
        if row.request is request and row.num_new_tokens:
            return row.end, in_flight.out.draft_depths
    return 0, in_flight.out.draft_depths


def _needed(engine: MMEngine, request_id: str) -> tuple[int, int]:
    """(the blocks a request needs after a step, those it would with every row chaining the step's longest): its
    tokens' and, while its row of the step in flight runs, every position that row may write: its tokens and its own
    chain past them (a chain of d drafts writes d - 1 positions past the row)."""
    request = engine.scheduler.requests[request_id]
    end, depths = _in_flight_end(engine, request)
    if not end:
        return cdiv(request.num_tokens, BLOCK), cdiv(request.num_tokens, BLOCK)
    own = max(depths.get(request_id, K), 1)
    most = max(max(depths.values(), default=0), 1)
    return cdiv(max(request.num_tokens, end + own - 1), BLOCK), cdiv(max(request.num_tokens, end + most - 1), BLOCK)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_requests_whose_drafts_are_rejected_hold_no_block_past_their_own_needs(async_scheduling):
    """Two requests whose chains differ near the end of the shorter one (its depth falls to what it can still emit):
    after every step each holds exactly its own needs; a row launched ahead keeps its own chain's blocks, not the
    step's longest. And a row's chain stores, so its drafts count, only as far as its own depth."""
    engine = MMEngine(str(tiny_qwen3_5_mtp_path()), device="cpu", dtype="float32", max_model_len=128, block_size=BLOCK,
                      speculative_config={"method": "mtp", "num_speculative_tokens": K, "draft_backoff": False},
                      async_scheduling=async_scheduling)
    for request_id, prompt_len, max_tokens in (("a", 15, 10), ("b", 9, 24)):
        engine.add_request({"prompt_token_ids": list(range(10, 10 + prompt_len))}, request_id=request_id,
                           sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    counted: list[dict[str, int]] = []  # each step read on the host: the drafts the head counted per request
    depths: list[dict[str, int]] = []  # and the depths that step was planned with
    received, update = engine.steps.drafts.drafter.received, engine.scheduler.update_from_output
    engine.steps.drafts.drafter.received = lambda drafts: (counted.append({r: len(d) for r, d in drafts.items()}), received(drafts))[1]
    engine.scheduler.update_from_output = lambda out, *args: (depths.append(dict(out.draft_depths or {})), update(out, *args))[1]
    held = []
    while engine.scheduler.requests:
        engine.step()
        for request in engine.scheduler.running:
            have = len(engine.kv_cache.block_ids(request.request_id))
            held.append((request.request_id, have, *_needed(engine, request.request_id)))
        assert_books_consistent(engine)
    stats = engine.stats()
    engine.shutdown()
    # the random head's drafts are (almost) all rejected: without the blocks given back, each step holds one more
    assert stats["spec_draft_tokens"] >= 4 * K and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] / 2
    assert len(held) >= 16 and all(have == need for _, have, need, _ in held), held
    if async_scheduling == "on":  # rows launched ahead whose own chain is shorter than the step's longest
        assert stats["steps_launched_ahead"] > 0 and sum(need < most for *_, need, most in held) >= 2, held
    pairs = [(counts, planned) for counts, planned in zip(counted, depths) if counts]
    assert all(n <= max(planned[r], 1) for counts, planned in pairs for r, n in counts.items()), pairs
    if async_scheduling == "off":  # steps where a request's chain is shorter than the other's
        assert any(min(planned.values()) < max(planned.values()) for _, planned in pairs if len(planned) == 2), pairs


class _WrongDrafts:
    """N-gram's place: K drafts every step, each the last token + 1 + i (a random model almost never samples them)."""

    def propose(self, request_id: str, token_ids, max_drafts: int) -> list[int]:
        return [(token_ids[-1] + 1 + i) % 50 for i in range(min(K, max_drafts))]

    def forget(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_windowed_models_rejected_drafts_give_back_their_window_blocks(async_scheduling, family_checkpoint):
    """Gemma 4 (sliding and full layers, a window of 8) verifying n-gram drafts: after every step the request holds
    exactly its tokens' blocks (and its row in flight's) in the full pool, and in the window pool those still in its
    window, the null block before them."""
    engine = MMEngine(str(family_checkpoint("gemma4")), device="cpu", dtype="float32", max_model_len=128, block_size=BLOCK,
                      speculative_config={"method": "ngram", "num_speculative_tokens": K, "draft_backoff": False},
                      async_scheduling=async_scheduling)
    engine.steps.drafts.proposer = _WrongDrafts()
    windows = engine.scheduler.caches.windows
    engine.add_request({"prompt_token_ids": list(range(10, 25))}, request_id="r",
                       sampling_params=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    held = []
    while "r" in engine.scheduler.requests:
        engine.step()
        if "r" in engine.scheduler.requests:
            request = engine.scheduler.requests["r"]
            need = cdiv(max(request.num_tokens, _in_flight_end(engine, request)[0]), BLOCK)
            in_window = need - windows.first_needed_block(request.num_computed_tokens)
            held.append((len(engine.kv_cache.block_ids("r")), len(windows.block_ids("r")), windows.num_held_blocks("r"),
                         need, need, in_window))
            assert_books_consistent(engine)
    stats = engine.stats()
    engine.shutdown()
    assert stats["spec_draft_tokens"] >= 4 * K and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] / 2
    assert len(held) >= 10 and all(h[:3] == h[3:] for h in held), held
