"""KeyedLock: work on one key is done by one thread at a time, different keys run at once, and no
lock outlives its last user."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mmengine.utils.keyed_lock import KeyedLock


def test_a_key_is_held_by_one_thread_at_a_time_and_the_work_is_done_once():
    locks, done, computed, inside, most_inside = KeyedLock(), {}, [], [0], [0]
    guard = threading.Lock()

    def get_or_compute(key: int) -> str:
        with locks.hold(key):
            with guard:
                inside[0] += 1
                most_inside[0] = max(most_inside[0], inside[0])
            try:
                if key not in done:
                    computed.append(key)
                    done[key] = f"value-{key}"
                return done[key]
            finally:
                with guard:
                    inside[0] -= 1

    keys = [i % 5 for i in range(200)]
    with ThreadPoolExecutor(16) as pool:
        values = list(pool.map(lambda k: get_or_compute(k), [0] * 50))  # one key: never two inside at once
        assert most_inside[0] == 1
        values += list(pool.map(get_or_compute, keys))
    assert sorted(computed) == [0, 1, 2, 3, 4]
    assert values[:50] == ["value-0"] * 50 and values[50:] == [f"value-{k}" for k in keys]
    assert len(locks) == 0


def test_different_keys_do_not_wait_for_each_other():
    locks = KeyedLock()
    took_b = threading.Event()

    def take_b() -> None:
        with locks.hold("b"):
            took_b.set()

    with locks.hold("a"):
        other = threading.Thread(target=take_b)
        other.start()
        assert took_b.wait(timeout=30)  # "b" was taken while "a" is held
        other.join()
    assert len(locks) == 0


def test_a_failure_releases_the_key_for_the_next_thread():
    locks = KeyedLock()
    with pytest.raises(RuntimeError):
        with locks.hold("k"):
            raise RuntimeError("injected")
    assert len(locks) == 0
    with locks.hold("k"):
        assert len(locks) == 1
    assert len(locks) == 0
