"""The driver's side of tensor parallelism: `tensor_parallel_size` worker processes (spawned), one step plan
sent to all of them, one reply from rank 0; and what happens when a worker fails or dies.

```
driver (the engine's process)                           workers (spawned, rank 0..tp-1; worker_loop.py)
execute(plan) --plan, pickled once, a pipe per rank-->  worker.execute_step(plan), collectives among the ranks
              <--(OK, result) from rank 0 alone-------  (submit(plan) / collect(): the same, split, so that the
                                                         driver schedules the next step while the ranks compute)
call(m, ...)  --(CALL, m, args) to every rank-------->  worker.m(...): set-up (load weights, profile)
              <--(OK, result) from every rank---------
```

Failure and lifetime:
- While a call waits, the driver waits on every rank's pipe and every process's sentinel at once: a worker
  that dies is noticed at once (its sentinel), never a hang. It becomes `EngineDeadError` naming the rank,
  for the call in progress and every later call; the other workers are stopped.
- A worker that raises sends its traceback; the driver raises `WorkerError` (an EngineDeadError) with it.
  When a peer died, the survivors' collectives fail too ("Connection closed by peer" in gloo, milliseconds
  later, possibly before the death reaches the driver): the driver then waits up to `death_grace_s` for a death
  and reports the death, the first cause.
- `shutdown()` (also on leaving a `with` block, or when the executor is collected) stops every worker: asked
  first, killed if they do not go. Workers leave when the driver dies (their lifeline pipe closes).
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait
from typing import Any

from mmengine.distributed.executor_base import Executor, WorkerError, worker_error
from mmengine.distributed.process_group import DistributedInit, free_tcp_address
from mmengine.distributed.worker_loop import ERROR, OK, WorkerFactory, worker_main
from mmengine.distributed.worker_processes import WorkerHandle, WorkerSet
from mmengine.errors import EngineDeadError

__all__ = ["MultiprocExecutor", "WorkerError"]


def watch(workers: WorkerSet, report: weakref.WeakMethod) -> None:
    """A thread: a worker that dies while no call waits (between steps) ends the executor all the same."""
    sentinels = workers.sentinels()
    try:
        ready = wait([*sentinels, workers.wake_reader])
    except (OSError, ValueError):
        return
    dead = [sentinels[obj] for obj in ready if obj in sentinels]
    mark_dead = report()
    if dead and not workers.stopping.is_set() and mark_dead is not None:
        mark_dead(EngineDeadError(dead[0].describe_death()))


class MultiprocExecutor(Executor):
    """Starts `tensor_parallel_size` workers, each `worker_factory(its TensorParallelGroup)` in a spawned
    process, and drives them (the calls: executor_base.Executor). The worker object has `execute_step(plan)`
    (rank 0's return value is the reply) and any methods `call` names; `close()`, when it has one, runs as its
    process stops.

    `rendezvous`: "tcp://127.0.0.1:PORT" or "file:///path" (None: a free TCP port on 127.0.0.1).
    """

    def __init__(self, worker_factory: WorkerFactory, tensor_parallel_size: int, *, device: str = "cpu",
                 backend: str | None = None, rendezvous: str | None = None, torch_threads: int | None = None,
                 start_timeout_s: float = 300.0, death_grace_s: float = 2.0,
                 on_death: Callable[[EngineDeadError], None] | None = None) -> None:
        super().__init__(tensor_parallel_size, death_grace_s, on_death)
        self.workers = WorkerSet()
        self.handles = self.workers.handles
        self.finalizer = weakref.finalize(self, self.workers.stop)
        address = rendezvous or free_tcp_address()
        context = multiprocessing.get_context("spawn")
        try:
            for rank in range(tensor_parallel_size):
                self.handles.append(self.spawn(context, DistributedInit(tensor_parallel_size, rank, address, device=device,
                                                                        backend=backend), worker_factory, torch_threads))
        except BaseException:  # an unpicklable factory: the ranks already started are stopped
            self.finalizer()
            raise
        ready = self.await_start(start_timeout_s)
        self.pids: list[int] = [ready[rank] for rank in range(tensor_parallel_size)]
        self.watcher = threading.Thread(target=watch, args=(self.workers, weakref.WeakMethod(self.mark_dead)),
                                        name="mmengine-tp-watcher", daemon=True)
        self.watcher.start()

    @staticmethod
    def spawn(context: Any, init: DistributedInit, worker_factory: WorkerFactory, torch_threads: int | None) -> WorkerHandle:
        conn, child_conn = context.Pipe()
        lifeline_reader, lifeline = context.Pipe(duplex=False)
        process = context.Process(target=worker_main, name=f"mmengine-tp-worker-{init.rank}", daemon=True,
                                  args=(init, worker_factory, child_conn, lifeline_reader, torch_threads))
        try:
            process.start()
        finally:
            child_conn.close()
            lifeline_reader.close()
        return WorkerHandle(init.rank, process, conn, lifeline)

    # -- the pipes ---------------------------------------------------------------------------------------------

    def encode(self, message: tuple[Any, ...]) -> bytes:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)

    def send(self, payload: bytes) -> None:
        for handle in self.handles:
            try:
                handle.conn.send_bytes(payload)
            except (OSError, ValueError):
                self.fail(self.first_death(self.death_grace_s) or EngineDeadError(handle.describe_death()))

    def await_replies(self, ranks: Iterable[int], kind: str = OK, timeout_s: float | None = None) -> dict[int, Any]:
        pending = set(ranks)
        results: dict[int, Any] = {}
        by_conn = {handle.conn: handle for handle in self.handles}
        by_sentinel = self.workers.sentinels()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self.fail(EngineDeadError(f"tensor-parallel workers {sorted(pending)} did not answer within {timeout_s:.0f} s"))
            try:
                ready = wait([*by_conn, *by_sentinel], timeout=remaining)
            except (OSError, ValueError):  # closed by a shutdown from another thread
                self.fail(EngineDeadError("the tensor-parallel executor has been shut down"))
            deaths = [by_sentinel[obj] for obj in ready if obj in by_sentinel]
            if deaths:
                self.fail(EngineDeadError(deaths[0].describe_death()))
            for obj in ready:
                handle = by_conn[obj]
                try:
                    reply = handle.conn.recv()
                except (EOFError, OSError):
                    self.fail(self.first_death(self.death_grace_s) or EngineDeadError(handle.describe_death()))
                if reply[0] == ERROR:  # after a failed collective, a peer's death is the cause to report
                    self.fail(self.first_death(self.death_grace_s if reply[-1] else 0.05) or worker_error(reply))
                if reply[0] == kind and handle.rank in pending:
                    results[handle.rank] = reply[-1]
                    pending.discard(handle.rank)
        return results

    def first_death(self, grace_s: float) -> EngineDeadError | None:
        sentinels = self.workers.sentinels()
        ready = wait(list(sentinels), timeout=grace_s)
        return EngineDeadError(sentinels[ready[0]].describe_death()) if ready else None

    def release(self) -> None:
        self.workers.release()

    def stop(self) -> None:
        self.finalizer()
