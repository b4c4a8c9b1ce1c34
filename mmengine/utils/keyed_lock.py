"""KeyedLock: one mutex per key, so work on a key is done by one thread at a time.

The pattern behind "never do the same work twice" across threads: a thread takes the key's lock,
looks for the result, and computes it only if it is not there. A thread that arrives while another
computes the same key waits, then finds the result (or, if that thread failed, computes it itself).
Locks exist only while some thread holds or waits for them.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class KeyedLock:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Hashable, tuple[threading.Lock, list[int]]] = {}  # key -> (lock, [holders + waiters])

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.setdefault(key, (threading.Lock(), [0]))
            users[0] += 1
        try:
            with lock:
                yield
        finally:
            with self._guard:
                users[0] -= 1
                if users[0] == 0:
                    del self._locks[key]

    def __len__(self) -> int:
        """How many keys some thread holds or waits for (0 when idle)."""
        with self._guard:
            return len(self._locks)
