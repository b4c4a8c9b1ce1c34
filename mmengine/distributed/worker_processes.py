"""The worker processes as the driver holds them: each one's process and two pipes, and how they all stop.

A worker is asked to stop (STOP on its pipe), then released (its lifeline closed: it leaves at once, even from
inside a collective), then killed. `WorkerSet.stop` is the executor's finalizer: it holds no executor, so an
executor nobody shut down is still collected, and its workers stopped.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from mmengine.distributed.worker_loop import STOP


@dataclass
class WorkerHandle:
    """One worker process and the driver's two pipes to it."""

    rank: int
    process: BaseProcess
    conn: Connection  # messages both ways
    lifeline: Connection  # never written: the worker leaves when it closes

    def describe_death(self) -> str:
        # The sentinel is ready as the process exits, a moment before waitpid can reap it: join() returns at once
        # then (its wait sees the sentinel) with no exit code yet, so poll until there is one (bounded).
        deadline = time.monotonic() + 5.0
        while self.process.exitcode is None and time.monotonic() < deadline:
            self.process.join(timeout=0.05)
            if self.process.exitcode is None:
                time.sleep(0.01)
        code = self.process.exitcode
        if code is None:
            how = "its pipe closed"
        elif code < 0:
            how = f"killed by {signal_name(-code)}"
        else:
            how = f"exit code {code}"
        return f"tensor-parallel worker rank {self.rank} (pid {self.process.pid}) died ({how})"


class WorkerSet:
    """Every worker's handle, and their stopping."""

    def __init__(self) -> None:
        self.handles: list[WorkerHandle] = []
        self.stopping = threading.Event()  # set first: deaths after it are the stop's, not failures
        self.wake_reader, self.wake_writer = multiprocessing.Pipe(duplex=False)  # closing it ends the watcher

    def sentinels(self) -> dict[int, WorkerHandle]:
        return {handle.process.sentinel: handle for handle in self.handles}

    def release(self) -> None:
        """Closes every lifeline: each worker leaves at once, even one stuck in a collective."""
        for handle in self.handles:
            handle.lifeline.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Asks every worker to stop, then closes their lifelines and kills any that remain. Runs once."""
        self.stopping.set()
        self.wake_writer.close()
        for handle in self.handles:
            if handle.process.is_alive():
                try:
                    handle.conn.send_bytes(pickle.dumps((STOP,)))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + timeout_s
        for handle in self.handles:
            handle.process.join(timeout=max(0.0, deadline - time.monotonic()))
        self.release()
        for handle in self.handles:
            if handle.process.is_alive():
                handle.process.join(timeout=1.0)
            if handle.process.is_alive():
                handle.process.kill()
                handle.process.join(timeout=5.0)
            handle.conn.close()


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
