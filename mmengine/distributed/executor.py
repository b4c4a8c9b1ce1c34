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
from typing import Any, NoReturn

from mmengine.distributed.process_group import DistributedInit, free_tcp_address
from mmengine.distributed.worker_loop import CALL, ERROR, OK, READY, STEP, WorkerFactory, worker_main
from mmengine.distributed.worker_processes import WorkerHandle, WorkerSet
from mmengine.errors import ConfigError, EngineDeadError, MMEngineError


class WorkerError(EngineDeadError):
    """A worker raised. `rank`, `error_type` and `traceback_text` say where and what; `error` is the worker's
    exception itself when it could cross the process boundary (else None)."""

    def __init__(self, rank: int, error_type: str, message: str, traceback_text: str, error: BaseException | None = None) -> None:
        self.rank = rank
        self.error_type = error_type
        self.message = message
        self.traceback_text = traceback_text
        self.error = error
        super().__init__(f"tensor-parallel worker rank {rank} raised {error_type}: {message}\n--- the worker's traceback ---\n{traceback_text}")

    def __reduce__(self):
        return (self.__class__, (self.rank, self.error_type, self.message, self.traceback_text, self.error))


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


class MultiprocExecutor:
    """Starts `tensor_parallel_size` workers, each `worker_factory(its TensorParallelGroup)` in a spawned
    process, and drives them. The worker object has `execute_step(plan)` (rank 0's return value is the reply)
    and any methods `call` names; `close()`, when it has one, runs as its process stops.

    `rendezvous`: "tcp://127.0.0.1:PORT" or "file:///path" (None: a free TCP port on 127.0.0.1).
    `on_death(error)` is called once, from whichever thread notices first, when the workers fail or die (a
    call in progress or not; not on shutdown): the engine's way to fail its requests and its server's to 503.
    """

    def __init__(self, worker_factory: WorkerFactory, tensor_parallel_size: int, *, device: str = "cpu",
                 backend: str | None = None, rendezvous: str | None = None, torch_threads: int | None = None,
                 start_timeout_s: float = 300.0, death_grace_s: float = 2.0,
                 on_death: Callable[[EngineDeadError], None] | None = None) -> None:
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
        self.tensor_parallel_size = tensor_parallel_size
        self.death_grace_s = death_grace_s
        self.on_death = on_death
        self.dead_error: EngineDeadError | None = None
        self.num_submitted = 0  # steps sent by submit() whose results collect() has not read
        self.lock = threading.Lock()  # one call at a time
        self.state_lock = threading.Lock()
        self.workers = WorkerSet()
        self.handles = self.workers.handles
        self.finalizer = weakref.finalize(self, self.workers.stop)
        self.watcher: threading.Thread | None = None
        address = rendezvous or free_tcp_address()
        context = multiprocessing.get_context("spawn")
        try:
            for rank in range(tensor_parallel_size):
                self.handles.append(self.spawn(context, DistributedInit(tensor_parallel_size, rank, address, device=device,
                                                                        backend=backend), worker_factory, torch_threads))
        except BaseException:  # an unpicklable factory: the ranks already started are stopped
            self.finalizer()
            raise
        try:
            ready = self.await_replies(range(tensor_parallel_size), kind=READY, timeout_s=start_timeout_s)
        except WorkerError as err:
            if isinstance(err.error, MMEngineError):  # a bad option or checkpoint, raised as itself
                raise err.error from err
            raise
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

    # -- the calls --------------------------------------------------------------------------------------------

    def execute(self, plan: Any) -> Any:
        """Sends `plan` to every rank (`execute_step`) and returns rank 0's result."""
        with self.lock:
            self.check_alive()
            if self.num_submitted:
                raise RuntimeError(f"execute() with {self.num_submitted} submitted step(s) not collected")
            return self.round_trip((STEP, plan), [0])[0]

    def submit(self, plan: Any) -> None:
        """Sends `plan` to every rank without waiting (async scheduling): `collect()` returns rank 0's results in
        the order the plans were sent. A call (`call`, `execute`) waits for none of them: collect them first."""
        with self.lock:
            self.check_alive()
            data = pickle.dumps((STEP, plan), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                self.broadcast(data)
            except EngineDeadError:
                raise
            except BaseException as err:
                self.mark_dead(EngineDeadError(f"a step sent to the tensor-parallel workers was interrupted ({type(err).__name__})"))
                self.finalizer()
                raise
            self.num_submitted += 1

    def collect(self) -> Any:
        """Rank 0's result of the oldest plan `submit` sent."""
        with self.lock:
            if not self.num_submitted:
                raise RuntimeError("collect() without a submitted step")
            self.check_alive()
            try:
                result = self.await_replies([0])[0]
            except EngineDeadError:
                raise
            except BaseException as err:  # the reply would answer the next collect
                self.mark_dead(EngineDeadError(f"a wait for the tensor-parallel workers was interrupted ({type(err).__name__})"))
                self.finalizer()
                raise
            self.num_submitted -= 1
            return result

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs `worker.method(*args, **kwargs)` on every rank; their results, by rank."""
        with self.lock:
            self.check_alive()
            if self.num_submitted:
                raise RuntimeError(f"call({method!r}) with {self.num_submitted} submitted step(s) not collected")
            results = self.round_trip((CALL, method, args, kwargs), range(self.tensor_parallel_size))
            return [results[rank] for rank in range(self.tensor_parallel_size)]

    def round_trip(self, message: tuple[Any, ...], ranks: Iterable[int]) -> dict[int, Any]:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # once, for every rank (a bad plan: no harm)
        try:
            self.broadcast(data)
            return self.await_replies(ranks)
        except EngineDeadError:
            raise
        except BaseException as err:  # a KeyboardInterrupt mid-call: the replies would answer the next call
            self.mark_dead(EngineDeadError(f"a call to the tensor-parallel workers was interrupted ({type(err).__name__})"))
            self.finalizer()
            raise

    def shutdown(self) -> None:
        """Stops every worker (idempotent); every later call raises EngineDeadError. A call in flight in another
        thread is not waited for: its workers are released at once and it raises EngineDeadError too."""
        idle = self.lock.acquire(blocking=False)
        try:
            self.mark_dead(EngineDeadError("the tensor-parallel executor has been shut down"), graceful=True)
            if not idle:
                self.workers.release()
            self.finalizer()
        finally:
            if idle:
                self.lock.release()
        if self.watcher is not None and threading.current_thread() is not self.watcher:
            self.watcher.join(timeout=5.0)

    def __enter__(self) -> MultiprocExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None

    def check_alive(self) -> None:
        """Raises EngineDeadError once the executor is dead; notices a death since the last call at once."""
        if self.dead_error is None:
            death = self.first_death(0.0)
            if death is not None:
                self.fail(death)
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error)) from self.dead_error

    # -- the pipes ---------------------------------------------------------------------------------------------

    def broadcast(self, data: bytes) -> None:
        for handle in self.handles:
            try:
                handle.conn.send_bytes(data)
            except (OSError, ValueError):
                self.fail(self.first_death(self.death_grace_s) or EngineDeadError(handle.describe_death()))

    def await_replies(self, ranks: Iterable[int], kind: str = OK, timeout_s: float | None = None) -> dict[int, Any]:
        """Each of `ranks`' reply of `kind`; a death, a worker's error or the timeout ends the executor."""
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
        """A worker that has died, or dies within `grace_s`: what a peer's failed collective points at."""
        sentinels = self.workers.sentinels()
        ready = wait(list(sentinels), timeout=grace_s)
        return EngineDeadError(sentinels[ready[0]].describe_death()) if ready else None

    def mark_dead(self, error: EngineDeadError, graceful: bool = False) -> EngineDeadError:
        """Keeps the first cause. A failure (not `graceful`) releases every worker at once and is reported to
        `on_death`; a shutdown asks them to stop."""
        with self.state_lock:
            first = self.dead_error is None
            if first:
                self.dead_error = error
        if first and not graceful:
            self.workers.release()
            if self.on_death is not None:
                self.on_death(error)
        return self.dead_error  # type: ignore[return-value]

    def fail(self, error: EngineDeadError) -> NoReturn:
        """Ends the call in progress (and the executor) with the first cause."""
        dead = self.mark_dead(error)
        self.finalizer()
        raise dead


def worker_error(reply: tuple[Any, ...]) -> WorkerError:
    _, rank, error_type, message, traceback_text, pickled, _ = reply
    error = None
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - the text says it all
            error = None
    return WorkerError(rank, error_type, message, traceback_text, error)
