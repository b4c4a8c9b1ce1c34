"""Scheduler decisions without a model: budgets, chunking, preemption, encoder work, stop rules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import make_request, make_scheduler
from mmengine.core.request import RequestStatus
from mmengine.core.scheduler import Scheduler

EOS = frozenset({0})


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    return out, sched.update_from_output(out, sampled, EOS)


def test_long_prompt_is_chunked_under_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8, block_size=8)
    req = make_request("a", 20)
    sched.add_request(req)
    chunks = []
    while not req.output_token_ids:
        out, _ = run_step(sched)
        chunks.append(out.scheduled[0].num_new_tokens)
    assert chunks == [8, 8, 4]
    assert req.num_computed_tokens == 20


def test_decodes_go_first_and_prefills_share_the_rest():
    sched = make_scheduler(max_num_batched_tokens=10, block_size=8)
    first = make_request("a", 6, max_tokens=5)
    sched.add_request(first)
    run_step(sched)  # prefill a
    sched.add_request(make_request("b", 30))
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 3))
    out, _ = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_preemption_evicts_the_latest_request_and_requeues_it_first():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 7, max_tokens=8, tokens=list(range(100, 107)))
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # a holds 2 blocks, b holds 2 blocks: cache full
    assert sched.kv_cache.num_free_blocks == 0
    out, _ = run_step(sched)  # a needs a third block: b is preempted
    assert out.preempted_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and b.output_token_ids == [7]
    assert [s.request.request_id for s in out.scheduled] == ["a"]


def test_request_that_preempts_itself_waits():
    sched = make_scheduler(num_blocks=2, block_size=4)
    a = make_request("a", 8, max_tokens=4)
    sched.add_request(a)
    run_step(sched)
    out, _ = run_step(sched)
    assert out.preempted_ids == ["a"] and out.scheduled == []
    assert sched.kv_cache.num_free_blocks == 2


def test_encoder_items_are_encoded_once_and_released_when_consumed():
    sched = make_scheduler(max_num_batched_tokens=6)
    req = make_request("a", 20, images=[(2, 8), (12, 4)])
    sched.add_request(req)
    outs = [run_step(sched)[0] for _ in range(4)]  # tokens 0-5, 6-11, 12-17, 18-19
    assert [s.encoder_items for o in outs[:3] for s in o.scheduled] == [[0], [], [1]]
    entries = sched.encoder_cache.entries
    assert entries["img0"].refs == set() and entries["img1"].refs == set()  # consumed: released
    assert outs[1].freed_encoder_hashes == []  # unreferenced entries stay resident


def test_aborting_releases_references_and_blocks():
    sched = make_scheduler(max_num_batched_tokens=4)
    req = make_request("a", 12, images=[(1, 10)])
    sched.add_request(req)
    run_step(sched)
    assert sched.encoder_cache.entries["img0"].refs == {("a", 0)}
    sched.abort_request("a")
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert sched.encoder_cache.entries["img0"].refs == set()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_stop_rules():
    sched = make_scheduler()
    eos, stop_tok, length, ignore = (
        make_request("eos", 3),
        make_request("stoptok", 3, stop_token_ids=[7]),
        make_request("len", 3, max_tokens=2),
        make_request("ignore", 3, max_tokens=2, ignore_eos=True),
    )
    for r in (eos, stop_tok, length, ignore):
        sched.add_request(r)
    out = sched.schedule()
    tokens = {"eos": 0, "stoptok": 7, "len": 5, "ignore": 0}
    sched.update_from_output(out, tokens, EOS)
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason == 0
    assert stop_tok.status == RequestStatus.FINISHED_STOPPED and stop_tok.stop_reason == 7
    assert length.status == RequestStatus.RUNNING and ignore.status == RequestStatus.RUNNING
    out = sched.schedule()
    sched.update_from_output(out, {"len": 5, "ignore": 0}, EOS)
    assert length.status == RequestStatus.FINISHED_LENGTH and ignore.status == RequestStatus.FINISHED_LENGTH


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=12),
    st.integers(1, 24),
    st.integers(14, 40),
)
def test_random_workloads_finish_without_leaks(specs, budget, num_blocks):
    """Every request finishes with exactly max_tokens outputs; budgets hold every step; nothing leaks."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
    requests = []
    for i, (n, max_tokens, num_images) in enumerate(specs):
        n = min(n, num_blocks * 4 - max_tokens)
        images = [(j * n // 3, max(1, n // 4)) for j in range(num_images) if j * n // 3 + max(1, n // 4) <= n]
        hashes = [f"img{(i + j) % 3}-{length}" for j, (_, length) in enumerate(images)]
        requests.append(make_request(f"r{i}", n, max_tokens=max_tokens, images=images, image_hashes=hashes, ignore_eos=True))
        sched.add_request(requests[-1])
    resident: set[str] = set()
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        out, _ = run_step(sched, token=0)
        assert 0 < out.num_scheduled_tokens <= budget
        resident -= set(out.freed_encoder_hashes)
        for s in out.scheduled:
            for idx in s.encoder_items:
                mm_hash = s.request.mm_items[idx].mm_hash
                assert mm_hash not in resident  # never encoded while already resident
                resident.add(mm_hash)
    assert not sched.has_unfinished_requests()
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in requests)
    assert sched.kv_cache.num_free_blocks == num_blocks
    assert resident == set(sched.encoder_cache.entries)
    assert sched.encoder_cache.num_referenced == 0


def test_a_stale_encoder_plan_commits_nothing():
    """A plan checked against books that changed since is refused before anything is taken."""
    import pytest

    from mmengine.core.scheduler import EncoderPlan

    sched = make_scheduler(num_blocks=8, block_size=4, encoder_capacity=8, max_num_batched_tokens=3)
    holder = make_request("holder", 6, images=[(1, 4)], image_hashes=["x"])
    sched.add_request(holder)
    run_step(sched)  # "x" is resident and referenced until holder's prefill gets past it
    req = make_request("a", 12, images=[(1, 4), (6, 4)], image_hashes=["x", "y"])
    free_before, used_before = sched.kv_cache.num_free_blocks, sched.encoder_cache.num_used
    # "y" does not fit next to the referenced "x" in a cache of 8 unless "x" is reused here
    too_big = EncoderPlan(encode=[1], reuse=[], cost=8)
    with pytest.raises(RuntimeError, match="no longer fits"):
        sched._commit(req, 0, 12, too_big, set())
    stale = EncoderPlan(encode=[0], reuse=[], cost=4)  # "x" is resident: encoding it again is stale
    with pytest.raises(RuntimeError, match="stale"):
        sched._commit(req, 0, 12, stale, set())
    assert sched.kv_cache.num_free_blocks == free_before and sched.encoder_cache.num_used == used_before
    assert "a" not in sched._held and sched.kv_cache.block_ids("a") == []
