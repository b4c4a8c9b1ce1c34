"""Blocks taken for drafts go back once the step that verified them is booked: a verify step's rejected drafts and a
draft head's chain past the step (DraftPlanner.take_draft_blocks) hold blocks only while a step in flight may still
write them, so a request whose drafts are rejected never keeps more blocks than its tokens and its running row need."""

from __future__ import annotations

import pytest

from books import assert_books_consistent
from helpers import make_request
from mmengine import MMEngine, SamplingParams
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.manager import KVCacheManager, cdiv
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


def _needed(engine: MMEngine, request_id: str) -> int:
    """The blocks a request needs after a step: its tokens' and, while its row of the step in flight runs, every
    position that row may write (its tokens and the head's chain past them)."""
    request = engine.scheduler.requests[request_id]
    tokens = request.num_tokens
    in_flight = engine.steps.in_flight
    if in_flight is not None:
        for row in in_flight.out.scheduled:
            if row.request is request and row.num_new_tokens:
                tokens = max(tokens, row.end + max(in_flight.out.draft_depths.values(), default=0) - 1)
    return cdiv(tokens, BLOCK)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_request_whose_drafts_are_rejected_holds_no_block_past_its_needs(async_scheduling):
    engine = MMEngine(str(tiny_qwen3_5_mtp_path()), device="cpu", dtype="float32", max_model_len=128, block_size=BLOCK,
                      speculative_config={"method": "mtp", "num_speculative_tokens": K, "draft_backoff": False},
                      async_scheduling=async_scheduling)
    engine.add_request({"prompt_token_ids": list(range(10, 25))}, request_id="r",
                       sampling_params=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    held = []
    while "r" in engine.scheduler.requests:
        engine.step()
        if "r" in engine.scheduler.requests:
            held.append((len(engine.kv_cache.block_ids("r")), _needed(engine, "r")))
            assert_books_consistent(engine)
    stats = engine.stats()
    engine.shutdown()
    # the random head's drafts are (almost) all rejected: without the blocks given back, each step holds one more
    assert stats["spec_draft_tokens"] >= 2 * K and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] / 2
    assert len(held) >= 8 and all(have == need for have, need in held), held
