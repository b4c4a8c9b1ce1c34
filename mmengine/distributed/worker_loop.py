"""The worker process's side of the executor: join the group, build the worker, serve the driver's messages.

```
driver --(STEP, plan)-------------------> every rank: worker.execute_step(plan); rank 0 alone replies (OK, result)
driver --(CALL, method, args, kwargs)---> every rank: worker.method(*args, **kwargs); every rank replies (OK, result)
driver --(STOP,)------------------------> every rank leaves the loop, the group, and exits
any rank that raises -------------------> (ERROR, rank, type name, message, traceback text, pickled error, collective?)
```

A worker never outlives its driver: a thread blocks on a lifeline pipe whose only writer is the driver, and
leaves the process (os._exit) when that pipe closes, even while the main thread computes or waits in a
collective. Messages arrive as bytes pickled once by the driver for all ranks. A worker leaves by os._exit once
its close() has run (utils/process_exit.py `leave`).

A Ray actor rank (`ray_worker.py`) runs the same pieces without the pipes: `start_worker`, `run_message` for each
message (its reply is the actor call's return value), `close_worker`.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.distributed

from mmengine.distributed.process_group import DistributedInit, TensorParallelGroup, destroy_distributed, init_distributed
from mmengine.utils.process_exit import leave

STEP, CALL, STOP = "step", "call", "stop"
READY, OK, ERROR = "ready", "ok", "error"


class Worker(Protocol):
    """What a rank holds and runs: `execute_step(plan)` each step (rank 0's result is the reply); any other
    method the driver names through `MultiprocExecutor.call`; `close()`, optional, as the process stops."""

    def execute_step(self, plan: Any) -> Any: ...


WorkerFactory = Callable[[TensorParallelGroup], Worker]  # picklable: a top-level function or class (or a partial of one)


# What a failed collective says when a peer has gone (gloo, NCCL, torch's own): the driver then looks for that
# peer's death first, the cause, before reporting this error, the consequence.
PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "NCCL", "gloo", "timed out", "Timed out")


def is_collective_failure(err: BaseException) -> bool:
    if isinstance(err, torch.distributed.DistError):
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in PEER_GONE)


def error_reply(rank: int, err: BaseException) -> tuple[Any, ...]:
    """(ERROR, rank, type name, message, traceback text, the error pickled or None, a failed collective?)"""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    try:
        pickled: bytes | None = pickle.dumps(err)
        pickle.loads(pickled)
    except Exception:  # noqa: BLE001 - an error that does not cross is described by its text alone
        pickled = None
    return (ERROR, rank, type(err).__name__, str(err), text, pickled, is_collective_failure(err))


def watch_lifeline(lifeline: Connection) -> None:
    """Leaves the process as soon as the driver's end of the lifeline closes (the driver stopped or died)."""
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(0)


def worker_main(init: DistributedInit, factory: WorkerFactory, conn: Connection, lifeline: Connection,
                torch_threads: int | None = None) -> None:
    """The spawned process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the driver, which stops the workers
    threading.Thread(target=watch_lifeline, args=(lifeline,), name="mmengine-lifeline", daemon=True).start()
    try:
        worker = start_worker(init, factory, torch_threads)
    except BaseException as err:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(error_reply(init.rank, err))
        wait_for_stop(conn)  # exiting now would read as a death, hiding the error
        leave()
    conn.send((READY, init.rank, os.getpid()))
    try:
        serve(worker, init.rank, conn)
    finally:
        close_worker(worker)
    leave()


def start_worker(init: DistributedInit, factory: WorkerFactory, torch_threads: int | None = None) -> Worker:
    """Joins the group and builds the rank's worker (a worker process's start, and a Ray actor's)."""
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    return factory(init_distributed(init))


def close_worker(worker: Worker) -> None:
    """Runs the worker's close(), when it has one, and leaves the group."""
    close = getattr(worker, "close", None)
    if callable(close):
        close()
    destroy_distributed()


def wait_for_stop(conn: Connection) -> None:
    try:
        while pickle.loads(conn.recv_bytes())[0] != STOP:
            pass
    except EOFError:
        pass


def run_message(worker: Worker, rank: int, message: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """One STEP or CALL message run on this rank: the reply to send, (OK, result) or `error_reply`; None for a
    step on a rank other than 0 (rank 0 alone answers a step)."""
    kind = message[0]
    try:
        if kind == STEP:
            result = worker.execute_step(message[1])
        else:
            _, method, args, kwargs = message
            result = getattr(worker, method)(*args, **kwargs)
    except BaseException as err:  # noqa: BLE001 - every rank's failure goes to the driver
        return error_reply(rank, err)
    return (OK, result) if kind == CALL or rank == 0 else None


def serve(worker: Any, rank: int, conn: Connection) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message[0] == STOP:
            return
        reply = run_message(worker, rank, message)
        if reply is None:
            continue
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as err:  # noqa: BLE001 - an unpicklable result goes to the driver as an error
            data = pickle.dumps(error_reply(rank, err))
        conn.send_bytes(data)
