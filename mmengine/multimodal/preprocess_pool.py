"""Pictures prepared in worker processes: encoded bytes are decoded, checked, hashed and preprocessed away
from the engine process (and its GIL), and their tensors come back in shared memory, never as pickled
pixels (the fast path writes its output straight into a shared segment each worker keeps and reuses,
output_arena.py; torch passes the segment by file descriptor, once). On arrival the tensors are copied
into the engine process's own memory, which frees the segment for the worker's next picture: a live
shared tensor would hold a file descriptor and a mapping, and the processor cache keeps thousands of
pictures (one descriptor each would exhaust a 1024-descriptor limit).

Each worker (spawned: no state of the engine's is forked) builds the engine's own PicturePreparer from its
image processor and config, pickled (PreparerSpec): it reads no checkpoint file and loads no tokenizer. It is
driven by one supervisor thread here, one picture at a time. A worker that dies is respawned: the picture it was preparing fails with a
PreprocessingWorkerError naming it (the picture may be what killed it), the engine serves on, and a
picture sent to a worker already dead before it started is sent to the new one. Workers leave with the
pool (`close`) or with the engine's process (their end of the pipe closes).

Processes started with spawn import the caller's `__main__` module again: a script that makes an engine
with `mm_processor_workers` keeps its work under `if __name__ == "__main__":`, as with any spawn pool.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from mmengine.errors import InvalidInputError, PreprocessingWorkerError
from mmengine.models.family import EncoderInputs
from mmengine.multimodal.output_arena import OutputArena, copy_out
from mmengine.multimodal.picture_preparer import PicturePreparer, PreparerSpec
from mmengine.utils.process_exit import leave

logger = logging.getLogger(__name__)

_READY, _DONE, _FAILED = "ready", "done", "failed"
_JOIN_SECONDS = 5.0
_START_ATTEMPTS = 3  # a worker killed while it starts is started again, this many times in all
_IDLE_CHECK_SECONDS = 0.5  # how often an idle slot looks whether its worker still lives


@dataclass
class _Task:
    encoded: bytes
    index: int
    path: str | None
    future: Future = field(default_factory=Future)


class PreprocessPool:
    def __init__(self, spec: PreparerSpec, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"a preprocessing pool needs a worker, got {num_workers}")
        self.spec = spec
        self._pickled_spec = pickle.dumps(spec)  # once, here: an unpicklable spec fails its caller, not each worker
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._context = torch_mp.get_context("spawn")
        self._lock = threading.Lock()
        self.num_prepared = 0
        self.num_respawns = 0
        self.num_failed_by_death = 0
        self.num_in_flight = 0  # pictures sent to a worker and not yet answered
        self.num_started = 0  # worker processes that became ready (respawns included)
        self._started = threading.Condition(self._lock)
        self._closed = False
        self._slots = [_WorkerSlot(self, i) for i in range(num_workers)]
        for slot in self._slots:
            slot.thread.start()

    @property
    def num_workers(self) -> int:
        return len(self._slots)

    def wait_until_started(self, timeout: float | None = None) -> bool:
        """Waits until every worker is ready (or its slot broken); False if the timeout came first."""
        with self._started:
            return self._started.wait_for(
                lambda: all(slot.broken is not None or slot.ready for slot in self._slots), timeout)

    def worker_pids(self) -> list[int]:
        return [slot.process.pid for slot in self._slots if slot.process is not None and slot.process.pid is not None]

    def prepare(self, encoded: bytes, index: int, path: str | None = None) -> tuple[str, EncoderInputs]:
        """The picture's mm_hash and inputs, prepared by a worker (blocks until one has). A bad picture
        raises its typed error, as preparing it here would."""
        if self._closed:
            raise RuntimeError("the preprocessing pool is closed")
        task = _Task(encoded, index, path)
        self._tasks.put(task)
        return task.future.result()

    def close(self) -> None:
        """Stops every worker (each finishes the picture it is preparing; one still starting is killed, since it has
        nothing to finish and may take seconds to start) and waits for them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._slots:
            self._tasks.put(None)
        for slot in self._slots:
            slot.kill_if_starting()
        for slot in self._slots:
            slot.thread.join()


class _WorkerSlot:
    """One worker process and the thread that feeds it, respawning it when it dies."""

    def __init__(self, pool: PreprocessPool, number: int) -> None:
        self.pool = pool
        self.number = number
        self.process: Any = None
        self.connection: Any = None
        self.broken: BaseException | None = None  # the worker could not start: every picture fails with this
        self.ready = False  # its current worker process is up
        self.segment: Any = None  # the current worker's output segment (output_arena.py), mapped once it is sent
        self.thread = threading.Thread(target=self._run, name=f"mmengine-preprocess-worker-{number}", daemon=True)

    def _run(self) -> None:
        try:
            self._spawn()
            while True:
                try:
                    task = self.pool._tasks.get(timeout=_IDLE_CHECK_SECONDS)
                except queue.Empty:  # idle: a worker that died meanwhile is replaced now, not at its next picture
                    if self.broken is None and not self.process.is_alive():
                        self._respawn(f"exit code {self._reap()}, while idle")
                    continue
                if task is None:
                    return
                if task.future.set_running_or_notify_cancel():
                    try:
                        self._serve(task)
                    except BaseException as err:  # never leave a caller waiting on a future nobody resolves
                        if not task.future.done():
                            task.future.set_exception(PreprocessingWorkerError(
                                f"image {task.index}: preparing it failed: {type(err).__name__}: {err}"))
                        raise
        finally:
            self._stop()

    def kill_if_starting(self) -> None:
        process = self.process
        if not self.ready and process is not None and process.is_alive():
            process.kill()  # its slot's thread sees it die, and starts no other: the pool is closed

    def _serve(self, task: _Task) -> None:
        for attempt in range(2):  # a worker found dead before it took the picture: once more, on a new one
            if self.broken is not None:
                task.future.set_exception(self.broken)
                return
            if not self.process.is_alive():  # died while idle: the picture has nothing to do with it
                self._respawn(f"exit code {self._reap()}")
                continue
            try:
                self.connection.send((task.encoded, task.index, task.path))
            except (OSError, ValueError):  # a dead worker's pipe
                self._respawn("its pipe closed")
                continue
            with self.pool._lock:
                self.pool.num_in_flight += 1
            try:
                ready = wait([self.connection, self.process.sentinel])
            finally:
                with self.pool._lock:
                    self.pool.num_in_flight -= 1
            if self.connection in ready:
                try:
                    status, payload = self.connection.recv()
                except (EOFError, OSError):
                    pass
                else:
                    self._finish(task, status, payload)
                    return
            exit_code = self._reap()
            self.pool.num_failed_by_death += 1
            task.future.set_exception(PreprocessingWorkerError(
                f"image {task.index}: the preprocessing worker died (exit code {exit_code}) while preparing it; "
                "it was restarted"
            ))
            self._respawn(f"exit code {exit_code}")
            return
        task.future.set_exception(PreprocessingWorkerError(f"image {task.index}: no preprocessing worker could take it"))

    def _finish(self, task: _Task, status: str, payload: Any) -> None:
        if status != _DONE:
            task.future.set_exception(payload)
            return
        mm_hash, layout, segment = payload
        if segment is not None:  # the worker's new (or grown) segment
            self.segment = segment
        try:
            inputs = copy_out(layout, self.segment)  # before the worker gets its next picture, which may write over it
        except PreprocessingWorkerError as err:
            task.future.set_exception(PreprocessingWorkerError(f"image {task.index}: {err}"))
            return
        with self.pool._lock:
            self.pool.num_prepared += 1
        task.future.set_result((mm_hash, inputs))

    def _spawn(self) -> None:
        """Starts the worker and waits for it to be ready. One that reports why it cannot start (a checkpoint
        it cannot read) leaves the slot broken; one that just dies is started again, up to _START_ATTEMPTS."""
        for attempt in range(_START_ATTEMPTS):
            if attempt:
                self._stop()
            if self.pool._closed:
                return
            status, payload = self._start_one()
            if status == _READY:
                with self.pool._started:
                    self.ready = True
                    self.pool.num_started += 1
                    self.pool._started.notify_all()
                return
            if isinstance(payload, BaseException) or self.pool._closed:
                break
        if self.pool._closed and not isinstance(payload, BaseException):
            return  # killed while starting by the pool's close
        self.broken = payload if isinstance(payload, BaseException) else PreprocessingWorkerError(
            f"a preprocessing worker could not start (exit code {self.process.exitcode})")
        logger.error("preprocessing worker %d could not start: %s", self.number, self.broken)
        with self.pool._started:
            self.pool._started.notify_all()

    def _start_one(self) -> tuple[str | None, Any]:
        context = self.pool._context
        ours, theirs = context.Pipe()
        self.process = context.Process(target=worker_process_main, args=(self.pool._pickled_spec, theirs), daemon=True,
                                       name=f"mmengine-preprocess-{self.number}")
        self.process.start()
        theirs.close()
        self.connection = ours
        ready = wait([ours, self.process.sentinel])
        try:
            if ours in ready:
                return ours.recv()
        except (EOFError, OSError):
            pass
        self._reap()
        return None, None

    def _respawn(self, why: str) -> None:
        logger.warning("preprocessing worker %d died (%s): starting a new one", self.number, why)
        self._stop()
        with self.pool._lock:
            self.pool.num_respawns += 1
        self._spawn()

    def _reap(self) -> int | None:
        self.process.join(_JOIN_SECONDS)
        return self.process.exitcode

    def _stop(self) -> None:
        self.ready = False
        self.segment = None
        if self.connection is not None:
            try:
                self.connection.send(None)
            except (OSError, ValueError):
                pass
            self.connection.close()
            self.connection = None
        if self.process is not None:
            self.process.join(_JOIN_SECONDS)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(_JOIN_SECONDS)
            self.process = None


def _tell_pool(connection: Any, message: tuple) -> bool:
    """Sends a start-up message; False if the pool's process is gone (its pipe closed while this worker started)."""
    try:
        connection.send(message)
    except OSError:  # BrokenPipeError: nobody is left to tell
        return False
    return True


def worker_process_main(pickled_spec: bytes, connection: Any) -> None:
    """A worker process's entry: worker_main, then it leaves without the interpreter's teardown, which with torch
    and transformers loaded took about 1.5 s of CPU on a loaded 2-core machine (the pool's close waits for it);
    what the worker holds (its pipe, its shared segments' descriptors) is released with the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the engine's process, which stops the pool
    worker_main(pickled_spec, connection)
    leave()


def worker_main(pickled_spec: bytes, connection: Any) -> None:
    """A worker process: builds the engine's PicturePreparer from its pickled PreparerSpec (unpickled here, so
    that a failure is reported like any other), then prepares one picture per message until told to stop
    (None) or its pipe closes (the engine's process is gone)."""
    torch.set_num_threads(1)
    try:
        preparer = PicturePreparer.from_spec(pickle.loads(pickled_spec))
    except BaseException as err:  # noqa: BLE001 - reported to the engine, which names it for every picture
        _tell_pool(connection, (_FAILED, _picklable(err)))
        return
    preparer.warm_up()
    if not _tell_pool(connection, (_READY, os.getpid())):
        return
    arena = OutputArena()
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        encoded, index, path = message
        try:
            arena.start()
            mm_hash, inputs = preparer.prepare_encoded(encoded, index, path, allocate=arena.allocate)
            layout = arena.layout(inputs)
            reply = (_DONE, (mm_hash, layout, arena.take_new_segment()))
        except InvalidInputError as err:
            reply = (_FAILED, err)
        except Exception as err:  # noqa: BLE001 - any other failure is the picture's, named
            reply = (_FAILED, PreprocessingWorkerError(f"image {index}: preparing it failed: {type(err).__name__}: {err}"))
        connection.send(reply)
        del reply


def _picklable(err: BaseException) -> BaseException:
    if isinstance(err, InvalidInputError):
        return err
    try:
        pickle.dumps(err)
        return err
    except Exception:  # noqa: BLE001
        return PreprocessingWorkerError(f"a preprocessing worker could not start: {type(err).__name__}: {err}")
