"""PreparingBatch (engine/intake.py): a batch's prompts handed out as each becomes ready, in whatever order
that is, each once with its input index; several bad prompts raise the lowest failed one's error; a batch
already prepared comes out in input order. Futures completed here by hand: no pool, no timing."""

from __future__ import annotations

import threading
import types
from concurrent.futures import Future

import pytest

from mmengine.engine.intake import PreparingBatch
from mmengine.errors import CorruptImageError

JOIN_S = 60.0  # a bound on a waiting thread's end, generous for a loaded machine: reaching it means it never woke


class PoolFuture(Future):
    """A future as a thread pool's: one dropped before it started is marked so at once (the pool's thread would
    on taking it up), so a wait for it ends."""

    def cancel(self) -> bool:
        dropped = super().cancel()
        if dropped:
            self.set_running_or_notify_cancel()
        return dropped


def requests(n: int) -> list[types.SimpleNamespace]:
    """Stand-ins for PreparedRequest: the batch hands them out as they are, without reading them."""
    return [types.SimpleNamespace(name=f"request {index}") for index in range(n)]


def test_ready_prompts_are_handed_out_out_of_order_each_once():
    futures = [PoolFuture() for _ in range(4)]
    made = requests(4)
    batch = PreparingBatch(futures)
    assert batch.take_ready() == [] and not batch.complete
    futures[2].set_result(made[2])
    assert batch.take_ready() == [(2, made[2])]  # prompts 0 and 1 not ready hold it back no longer
    assert batch.take_ready() == []  # handed out once
    futures[3].set_result(made[3])
    futures[0].set_result(made[0])
    assert batch.take_ready() == [(0, made[0]), (3, made[3])]  # those ready at once: in input order
    assert not batch.complete
    futures[1].set_result(made[1])
    assert batch.take_ready() == [(1, made[1])]
    assert batch.complete and batch.take_ready() == []


def test_an_already_prepared_batch_is_handed_out_in_input_order():
    made = requests(5)
    batch = PreparingBatch.of(made)
    assert batch.take_ready() == list(enumerate(made))
    assert batch.complete and len(batch) == 5


def test_several_bad_prompts_raise_the_lowest_failed_one_after_waiting_for_those_started():
    """Prompt 3 fails first while prompt 1 is still being prepared (running: it cannot be dropped) and prompt 0
    has not started; prompt 1 fails while the batch waits for it. The error raised is prompt 1's (the lowest
    input index that failed), prompt 0 and 2 are dropped, and prompt 4's result is not handed out."""
    futures = [PoolFuture() for _ in range(5)]
    made = requests(5)
    futures[1].set_running_or_notify_cancel()
    # prompt 0's cancellation runs its callbacks at once: prompt 1 fails while cancel() goes on to wait for it
    futures[0].add_done_callback(lambda _: futures[1].set_exception(CorruptImageError("prompt 1: image 0: truncated")))
    futures[4].set_result(made[4])
    futures[3].set_exception(CorruptImageError("prompt 3: image 0: truncated"))
    batch = PreparingBatch(futures)
    with pytest.raises(CorruptImageError, match=r"^prompt 1: "):
        batch.take_ready()
    assert futures[0].cancelled() and futures[2].cancelled()


def test_a_bad_prompt_ready_beside_good_ones_raises_and_hands_out_none():
    futures = [PoolFuture() for _ in range(3)]
    made = requests(3)
    futures[0].set_result(made[0])
    futures[2].set_exception(CorruptImageError("prompt 2: image 0: truncated"))
    batch = PreparingBatch(futures)
    with pytest.raises(CorruptImageError, match=r"^prompt 2: "):
        batch.take_ready()
    assert futures[1].cancelled()


def test_wait_for_next_wakes_for_any_prompt_not_handed_out():
    """Prompt 0 stays unprepared; prompt 2 becoming ready ends the wait (an unbounded one: waiting for prompt 0
    alone would never end)."""
    futures = [PoolFuture() for _ in range(3)]
    made = requests(3)
    futures[1].set_result(made[1])
    batch = PreparingBatch(futures)
    assert batch.take_ready() == [(1, made[1])]
    waiter = threading.Thread(target=batch.wait_for_next, args=(None,), daemon=True)
    waiter.start()
    futures[2].set_result(made[2])
    waiter.join(JOIN_S)
    woke = not waiter.is_alive()
    futures[0].set_result(made[0])  # ends a waiter that did not wake, so no thread is left behind
    waiter.join(JOIN_S)
    assert woke
    assert batch.take_ready() == [(0, made[0]), (2, made[2])]
