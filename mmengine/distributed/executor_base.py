"""What every tensor-parallel executor does, whatever carries its messages (worker processes and pipes:
`executor.py`; Ray actors: `ray_executor.py`).

```
execute(plan)   (STEP, plan) to every rank, encoded once    -> rank 0's reply
submit(plan)    the same, not waited for (async scheduling)    collect(): rank 0's replies, in the order sent
call(m, ...)    (CALL, m, args, kwargs) to every rank       -> every rank's reply
```

A transport says how a message is encoded once (`encode`, before anything is sent: a plan that cannot be
encoded harms nothing), sent to every rank (`send`), and how the replies to the oldest message not yet read come
back (`await_replies`, which also watches every rank for its death); `first_death` finds a death, `release` lets
every worker go at once (a failure), `stop` stops them (asked, then killed; once).

Failure: the first cause is kept (`mark_dead`), reported once to `on_death`, and every later call raises it as
EngineDeadError. A call interrupted mid-way (KeyboardInterrupt) ends the executor too: its replies would answer
the next call.
"""

from __future__ import annotations

import pickle
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from mmengine.distributed.worker_loop import CALL, OK, READY, STEP
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


def worker_error(reply: tuple[Any, ...]) -> WorkerError:
    """The WorkerError of a worker's `error_reply` (worker_loop.py)."""
    _, rank, error_type, message, traceback_text, pickled, _ = reply
    error = None
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - the text says it all
            error = None
    return WorkerError(rank, error_type, message, traceback_text, error)


class Executor(ABC):
    """The calls, their order and the executor's death; a subclass is the transport (see the module's doc).

    `on_death(error)` is called once, from whichever thread notices first, when the workers fail or die (a call
    in progress or not; not on shutdown): the engine's way to fail its requests and its server's to 503.
    """

    def __init__(self, tensor_parallel_size: int, death_grace_s: float,
                 on_death: Callable[[EngineDeadError], None] | None) -> None:
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
        self.tensor_parallel_size = tensor_parallel_size
        self.death_grace_s = death_grace_s
        self.on_death = on_death
        self.dead_error: EngineDeadError | None = None
        self.num_submitted = 0  # steps sent by submit() whose results collect() has not read
        self.lock = threading.Lock()  # one call at a time
        self.state_lock = threading.Lock()
        self.watcher: threading.Thread | None = None  # notices a death while no call waits

    # -- the transport (subclasses) ----------------------------------------------------------------------------

    def encode(self, message: tuple[Any, ...]) -> Any:
        """`message` made ready to send to every rank, once; raising here harms nothing."""
        return message

    @abstractmethod
    def send(self, payload: Any) -> None:
        """Sends an encoded message to every rank; a rank found dead ends the executor (`fail`)."""

    @abstractmethod
    def await_replies(self, ranks: Iterable[int], kind: str = OK, timeout_s: float | None = None) -> dict[int, Any]:
        """Each of `ranks`' reply of `kind` to the oldest message not yet read; a death, a worker's error or the
        timeout ends the executor (`fail`)."""

    @abstractmethod
    def first_death(self, grace_s: float) -> EngineDeadError | None:
        """A worker that has died, or dies within `grace_s`: what a peer's failed collective points at."""

    @abstractmethod
    def release(self) -> None:
        """Lets every worker go at once, even one inside a collective (a failure, or a shutdown mid-call)."""

    @abstractmethod
    def stop(self) -> None:
        """Stops every worker: asked first, killed if they do not go. Idempotent."""

    def await_start(self, timeout_s: float) -> dict[int, Any]:
        """Every rank's READY reply (its pid). A worker that could not start raises its own error when it is an
        MMEngineError (a bad option or checkpoint), else WorkerError."""
        try:
            return self.await_replies(range(self.tensor_parallel_size), kind=READY, timeout_s=timeout_s)
        except WorkerError as err:
            if isinstance(err.error, MMEngineError):
                raise err.error from err
            raise

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
            payload = self.encode((STEP, plan))
            self.interruptible(self.send, payload, what="a step sent to")
            self.num_submitted += 1

    def collect(self) -> Any:
        """Rank 0's result of the oldest plan `submit` sent."""
        with self.lock:
            if not self.num_submitted:
                raise RuntimeError("collect() without a submitted step")
            self.check_alive()
            result = self.interruptible(self.await_replies, [0], what="a wait for")[0]
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
        payload = self.encode(message)  # once, for every rank (a bad plan: no harm)
        return self.interruptible(lambda: (self.send(payload), self.await_replies(ranks))[1], what="a call to")

    def interruptible(self, action: Callable[..., Any], *args: Any, what: str) -> Any:
        """Runs `action`; an interruption (a KeyboardInterrupt mid-call) ends the executor, whose replies would
        otherwise answer the next call."""
        try:
            return action(*args)
        except EngineDeadError:
            raise
        except BaseException as err:
            self.mark_dead(EngineDeadError(f"{what} the tensor-parallel workers was interrupted ({type(err).__name__})"))
            self.stop()
            raise

    def shutdown(self) -> None:
        """Stops every worker (idempotent); every later call raises EngineDeadError. A call in flight in another
        thread is not waited for: its workers are released at once and it raises EngineDeadError too."""
        idle = self.lock.acquire(blocking=False)
        try:
            self.mark_dead(EngineDeadError("the tensor-parallel executor has been shut down"), graceful=True)
            if not idle:
                self.release()
            self.stop()
        finally:
            if idle:
                self.lock.release()
        if self.watcher is not None and threading.current_thread() is not self.watcher:
            self.watcher.join(timeout=5.0)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- death ------------------------------------------------------------------------------------------------

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

    def mark_dead(self, error: EngineDeadError, graceful: bool = False) -> EngineDeadError:
        """Keeps the first cause. A failure (not `graceful`) releases every worker at once and is reported to
        `on_death`; a shutdown asks them to stop."""
        with self.state_lock:
            first = self.dead_error is None
            if first:
                self.dead_error = error
        if first and not graceful:
            self.release()
            if self.on_death is not None:
                self.on_death(error)
        return self.dead_error  # type: ignore[return-value]

    def fail(self, error: EngineDeadError) -> NoReturn:
        """Ends the call in progress (and the executor) with the first cause."""
        dead = self.mark_dead(error)
        self.stop()
        raise dead
