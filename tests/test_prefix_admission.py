"""Prefix-aware admission: sharing lets more requests in; skipping is bounded."""

from __future__ import annotations

from helpers import make_request
from helpers import make_scheduler as make_shared_scheduler
from mmengine.core.request import RequestStatus
from mmengine.core.scheduler import MAX_ADMISSION_SKIPS, Scheduler

EOS = frozenset({0})
PREFIX = list(range(100, 116))  # 4 blocks of 4


def make_scheduler(num_blocks: int, enable: bool, **kwargs) -> Scheduler:
    return make_shared_scheduler(num_blocks=num_blocks, enable_prefix_caching=enable, **kwargs)


def run_step(sched: Scheduler):
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: 5 for s in out.scheduled if s.samples}, EOS)
    return out


def shared_prefix_requests(n: int):
    return [make_request(f"r{i}", 19, max_tokens=2, tokens=PREFIX + [i, i, i]) for i in range(n)]


def test_sharing_admits_more_requests_under_the_same_capacity():
    """Each request alone needs 5 blocks (19 prompt tokens + 1); 12 blocks hold 2 unshared ones,
    or the 4 shared prefix blocks plus 8 requests with one private block each."""
    counts = {}
    for enable in (False, True):
        sched = make_scheduler(12, enable, max_num_batched_tokens=1000)
        requests = shared_prefix_requests(10)
        for request in requests:
            sched.add_request(request)
        run_step(sched)
        run_step(sched)
        counts[enable] = sum(r.status != RequestStatus.WAITING for r in requests)
    assert counts == {False: 2, True: 8}


def test_requests_wait_for_a_prefix_being_computed_instead_of_computing_it_again():
    sched = make_scheduler(64, True, max_num_batched_tokens=1000)
    for request in shared_prefix_requests(4):
        sched.add_request(request)
    first = run_step(sched)
    assert [s.request.request_id for s in first.scheduled] == ["r0"]
    second = run_step(sched)
    assert sorted((s.request.request_id, s.start, s.num_new_tokens) for s in second.scheduled) == [
        ("r0", 19, 1), ("r1", 16, 3), ("r2", 16, 3), ("r3", 16, 3)
    ]


def test_a_big_request_does_not_block_small_ones_forever_nor_starve():
    sched = make_scheduler(6, True, max_num_batched_tokens=1000)
    sched.add_request(make_request("filler", 3, max_tokens=8, tokens=[1, 2, 3]))
    run_step(sched)
    big = make_request("big", 23, max_tokens=1, tokens=list(range(500, 523)))  # needs all 6 blocks
    sched.add_request(big)
    admitted_before_big = 0
    for step in range(200):
        sched.add_request(make_request(f"s{step}", 3, max_tokens=2, tokens=[7, step, step + 1000]))
        out = run_step(sched)
        names = [s.request.request_id for s in out.scheduled]
        if "big" in names:
            break
        admitted_before_big += sum(1 for s in out.scheduled if s.start == 0)
    else:
        raise AssertionError("the big request starved")
    assert admitted_before_big >= MAX_ADMISSION_SKIPS  # small requests went ahead while it could not fit
    assert big.num_admission_skips == MAX_ADMISSION_SKIPS


def test_lora_identity_separates_caches():
    """Same tokens under different adapters never share KV blocks; under the same adapter they do."""
    sched = make_scheduler(64, True, max_num_batched_tokens=1000)

    def admit(name: str, lora: str | None):
        request = make_request(name, 19, max_tokens=1, tokens=PREFIX + [1, 2, 3], lora_name=lora)
        sched.add_request(request)
        while sched.has_unfinished_requests():
            run_step(sched)
        return request.num_cached_tokens

    assert admit("base", None) == 0
    assert admit("adapter-a", "a") == 0
    assert admit("adapter-b", "b") == 0
    assert admit("adapter-a-again", "a") == 16
    assert admit("base-again", None) == 16
