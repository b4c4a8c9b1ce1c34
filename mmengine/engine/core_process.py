"""The engine-core process: one MMEngine (scheduler, both caches, the model) that steps for its front ends.

`AsyncMMEngine.from_model(path, engine_core="process")` spawns it with one front end, the caller's process;
`mmengine serve --api-server-count N` (entrypoints/server_processes.py) spawns it with N front-end processes
that connect to its address (engine/core_client.py is their end):

```
front end (1 or N processes)                            engine core (spawned, 1)
intake: checks, tokenizing, media, preprocessing
  --("add", PreparedRequest: token ids, params, salt,    MMEngine.add_prepared_request
         items whose tensors cross by fd, shared memory,
         the front end's intake counters, whole_answer)-->
  --("abort", request id)-->                             MMEngine.abort_request
  --("expect", request id, max wait)-->                  a request being prepared: the next step waits for its add
  --("call", id, name, intake counters)-->              stats, reset_prefix_cache, reset_encoder_cache
  <--("outputs", [RequestOutput])--                      each step's outputs for that front end's requests
  <--("step_failed", why) / ("request_failed", id, error) / ("reply", id, ok, value)--
```

A whole answer's request (`whole_answer`: a non-streamed reply) is sent back twice, at its first token and at
its end: at its first token the core turns it with MMEngine.read_final_output_only, so it is stepped as
generate() steps its own (no output per step, its tokens decoded once at the end).

One logical engine: every front end's requests share the scheduler and both caches, so a picture is encoded
once whichever front end took it. Outputs go to the front end that sent the request; a front end that goes
away has its requests aborted. `stats()` sums the intake counters every front end last reported (those of
front ends gone included, so counters never go back). A picture crosses from a front end once: the core keeps
the pictures each front end sent, and that front end sends a picture it knows the core holds without its
tensors (engine/picture_mirror.py).

The core steps while it has work and reads its messages between steps; idle, it waits for one. A front end says
when it starts preparing a request ("expect"), and the core's next step waits for that request's add (or abort), up
to the wait the front end gave, so the request joins the step after the one running when it arrived, as in the
one-process server (engine/async_engine.py); one that does not come in time is not waited for again. It ends when
its owner (the process that spawned it) tells it to (None) or is gone, so it never outlives its owner for long: an
owner that is only a launcher (front ends of their own connected) and is gone leaves its front ends to stop too, and
the core serves them until they have left, for at most ORPHANED_SERVE_SECONDS (their answers in flight finish, and
what they share with the core outlives them).
The engine is built with the front end's options, without preprocessing workers: pictures arrive prepared.

The engine's modules (torch, transformers, the model code) are imported in the core process only: a launcher that
spawns the core (`mmengine serve --api-server-count N`) imports this module for `core_main`'s name and needs none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing import Pipe
from multiprocessing.connection import Connection, Listener, wait
from typing import TYPE_CHECKING, Any

from mmengine.errors import InvalidInputError
from mmengine.outputs import RequestOutput
from mmengine.utils.collector_pace import pace_collector_for_serving
from mmengine.utils.heap import freeze_startup_heap
from mmengine.utils.process_exit import leave

if TYPE_CHECKING:
    from mmengine.engine.intake import PreparedRequest
    from mmengine.engine.mm_engine import MMEngine

logger = logging.getLogger(__name__)

READY, FAILED = "ready", "failed"
ADD, ABORT, CALL, EXPECT = "add", "abort", "call", "expect"
OUTPUTS, STEP_FAILED, REQUEST_FAILED, REPLY = "outputs", "step_failed", "request_failed", "reply"
CALLS = ("stats", "reset_prefix_cache", "reset_encoder_cache")
# the owner gone: the front ends see it too and stop (uvicorn's graceful shutdown takes up to 5 s); the core serves
# them meanwhile, and leaves after this long whatever they do
ORPHANED_SERVE_SECONDS = 10.0


def core_main(model: str, options: dict[str, Any], owner: Connection, address: str | None = None,
              authkey: bytes | None = None) -> None:
    """The process's entry point: listens at `address` (when front ends of their own connect), builds the
    engine, says it is ready (with what a front end's intake needs to know of the caches), then serves until
    its owner tells it to stop or is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the owner, which stops the core
    listener = Listener(address, "AF_UNIX", authkey=authkey) if address is not None else None
    try:
        from mmengine.engine.mm_engine import MMEngine

        engine = MMEngine(model, **options)
    except BaseException as err:  # noqa: BLE001 - reported to the owner, which raises it
        owner.send((FAILED, picklable(err)))
        return
    processor = engine.input_processor
    info = {"pid": os.getpid(), "max_tokens_in_kv_cache": processor.max_tokens_in_kv_cache,
            "max_tokens_per_item": processor.max_tokens_per_item}
    owner.send((READY, info))
    freeze_startup_heap()
    pace_collector_for_serving()
    EngineCore(engine, owner, info, listener).serve()


def owned_core_main(model: str, options: dict[str, Any], owner: Connection) -> None:
    """The entry of a core spawned by its one front end (EngineCoreClient): core_main, then the process leaves
    without the interpreter's teardown (seconds of CPU with torch and the model loaded, which the front end's
    close waits for, killing the core after 5 s); what it holds is released by then."""
    core_main(model, options, owner)
    leave()


class EngineCore:
    def __init__(self, engine: MMEngine, owner: Connection, info: dict[str, Any], listener: Listener | None = None) -> None:
        from mmengine.engine.picture_mirror import ReceivedPictures
        from mmengine.engine.stats import processor_stats

        self._received_pictures, self._processor_stats = ReceivedPictures, processor_stats
        self.engine = engine
        self.owner = owner
        self.info = info
        self.front_ends: list[Connection] = [owner]
        self.owners: dict[str, Connection] = {}  # request id -> the front end that sent it
        self.whole_answers: set[str] = set()  # requests to turn read_final_output_only at their first token
        self.expected: dict[str, tuple[Connection, float]] = {}  # being prepared: request id -> (front end, max wait)
        # each front end's pictures, as its books say the core holds them (engine/picture_mirror.py); both sides
        # are built from the same options, so they keep the same capacity
        self.pictures: dict[Connection, ReceivedPictures] = {}
        self._pictures_bytes = engine.config.multimodal_config.mm_processor_cache_bytes
        self.intake_counters: dict[Connection, dict[str, int]] = {}  # each front end's, as it last reported them
        self.departed_counters: Counter[str] = Counter()  # the monotone ones of front ends gone
        self._joined: list[Connection] = []  # accepted by the listener thread, not served yet
        self._joined_lock = threading.Lock()
        self._wake_reader: Connection | None = None  # readable when the listener thread has accepted someone
        self._orphaned_until: float | None = None  # the owner is gone: when the core leaves whatever its front ends do
        if listener is not None:
            self._wake_reader, self._wake_writer = Pipe(duplex=False)
            threading.Thread(target=self._accept, args=(listener,), name="mmengine-core-accept", daemon=True).start()

    # -- front ends --------------------------------------------------------------

    def _accept(self, listener: Listener) -> None:
        """Accepts front ends for the life of the process (a failed handshake is that caller's problem)."""
        while True:
            try:
                connection = listener.accept()
            except (OSError, EOFError) as err:  # a caller with the wrong key, or one that hung up mid-handshake
                logger.warning("a front end could not connect: %s", err)
                continue
            with self._joined_lock:
                self._joined.append(connection)
            self._wake_writer.send_bytes(b"")

    def _adopt_joined(self) -> None:
        self._wake_reader.recv_bytes()
        with self._joined_lock:
            joined, self._joined = self._joined, []
        for connection in joined:
            if self._send(connection, (READY, self.info)):
                self.front_ends.append(connection)

    def _leave(self, connection: Connection) -> None:
        """A front end is gone: its requests are aborted, its counters kept."""
        self.front_ends.remove(connection)
        for request_id in [rid for rid, owner in self.owners.items() if owner is connection]:
            del self.owners[request_id]
            self.whole_answers.discard(request_id)
            self.engine.abort_request(request_id)
        self.pictures.pop(connection, None)
        for request_id in [rid for rid, (owner, _) in self.expected.items() if owner is connection]:
            del self.expected[request_id]
        counters = self.intake_counters.pop(connection, {})
        self.departed_counters.update({name: value for name, value in counters.items() if name != "mm_processor_cache_bytes"})
        connection.close()

    # -- the loop ----------------------------------------------------------------

    def serve(self) -> None:
        engine = self.engine
        while True:
            timeout = None if not engine.has_unfinished_requests() else 0
            if self._orphaned_until is not None:
                left = self._orphaned_until - time.monotonic()
                if not self.front_ends or left <= 0:
                    return
                timeout = left if timeout is None else timeout
            # Idle: wait for a message; with work: take what has come and step.
            watched = self.front_ends + ([self._wake_reader] if self._wake_reader is not None else [])
            for connection in wait(watched, timeout=timeout):
                if connection is self._wake_reader:
                    self._adopt_joined()
                    continue
                if not self._read(connection):
                    return
            if not engine.has_unfinished_requests():
                continue
            if self.expected and not self._await_expected():
                return
            try:
                outputs = engine.step()
            except Exception as err:  # noqa: BLE001 - the step advanced nothing: each front end decides whom to fail
                logger.exception("engine-core step failed")
                for connection in list(self.front_ends):
                    self._send(connection, (STEP_FAILED, f"{type(err).__name__}: {err}"))
                continue
            if outputs:
                self._deliver(outputs)

    def _await_expected(self) -> bool:
        """Before a step: reads messages until every request the front ends are preparing has been added (or
        aborted), for at most the longest wait they gave; those still missing then are not waited for again.
        False when the owner said stop or left."""
        deadline = time.monotonic() + max(wait for _, wait in self.expected.values())
        while self.expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.expected.clear()
                break
            watched = self.front_ends + ([self._wake_reader] if self._wake_reader is not None else [])
            for connection in wait(watched, timeout=remaining):
                if connection is self._wake_reader:
                    self._adopt_joined()
                elif not self._read(connection):
                    return False
        return True

    def _read(self, connection: Connection) -> bool:
        """Applies the messages waiting on one front end's connection; False when the owner said stop, or left and no
        other front end is connected."""
        try:
            while connection.poll(0):
                message = connection.recv()
                if message is None:
                    if connection is self.owner:
                        return False
                    self._leave(connection)
                    return True
                self._handle(connection, message)
        except (EOFError, OSError):  # that front end is gone
            if connection is self.owner:
                return self._owner_gone()
            self._leave(connection)
        return True

    def _owner_gone(self) -> bool:
        """The owner left without a word (killed). When it was a launcher, its front ends stop too: they are served
        until they have left (ORPHANED_SERVE_SECONDS at most). False when no other front end is connected."""
        self.front_ends.remove(self.owner)
        self.owner.close()
        if not self.front_ends:
            return False
        self._orphaned_until = time.monotonic() + ORPHANED_SERVE_SECONDS
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_front_end: dict[Connection, list[RequestOutput]] = {}
        for output in outputs:
            owner = self.owners.pop(output.request_id, None) if output.finished else self.owners.get(output.request_id)
            if owner is None:  # its front end left (the request was aborted)
                continue
            if output.request_id in self.whole_answers and (output.token_ids or output.finished):
                self.whole_answers.discard(output.request_id)
                if not output.finished:  # its first token: from now on only its final output comes
                    self.engine.read_final_output_only(output.request_id)
            _strip(output)
            by_front_end.setdefault(owner, []).append(output)
        for connection, batch in by_front_end.items():
            self._send(connection, (OUTPUTS, batch))

    def _handle(self, connection: Connection, message: Any) -> None:
        kind = message[0]
        if kind == ADD:
            _, prepared, counters, whole_answer = message
            prepared: PreparedRequest
            self.intake_counters[connection] = counters
            request_id = prepared.request_id
            self.expected.pop(request_id, None)
            try:
                pictures = self.pictures.setdefault(connection, self._received_pictures(self._pictures_bytes))
                items = pictures.fill(prepared.processed.mm_items)  # first: the books follow every message
                prepared = dataclasses.replace(prepared, processed=dataclasses.replace(prepared.processed, mm_items=items))
                if request_id in self.owners:
                    raise InvalidInputError(f"request id {request_id!r} is already in use")
                self.engine.add_prepared_request(prepared)
            except Exception as err:  # noqa: BLE001 - that request's failure, not the core's
                self._send(connection, (REQUEST_FAILED, request_id, picklable(err)))
            else:
                self.owners[request_id] = connection
                if whole_answer:
                    self.whole_answers.add(request_id)
        elif kind == EXPECT:
            if message[1] not in self.owners:
                self.expected[message[1]] = (connection, message[2])
        elif kind == ABORT:
            if self.expected.get(message[1], (None,))[0] is connection:
                del self.expected[message[1]]
            if self.owners.get(message[1]) is connection:
                # its owner stays until its final ("abort") output is delivered: the front end's books hold the
                # request until then (without that output, it would count as unfinished for ever)
                self.whole_answers.discard(message[1])
                self.engine.abort_request(message[1])
        elif kind == CALL:
            _, call_id, name, counters = message
            self.intake_counters[connection] = counters
            try:
                if name not in CALLS:
                    raise ValueError(f"the engine core serves no call {name!r}")
                value = getattr(self.engine, name)()
                if name == "stats":
                    value.update(self._intake_totals())
                self._send(connection, (REPLY, call_id, True, value))
            except Exception as err:  # noqa: BLE001 - handed to the caller
                self._send(connection, (REPLY, call_id, False, picklable(err)))

    def _intake_totals(self) -> dict[str, int]:
        """The intake counters summed over the front ends (pictures arrive here prepared: the core's own are 0)."""
        totals = Counter({name: 0 for name in self._processor_stats(self.engine.input_processor)})
        totals.update(self.departed_counters)
        for counters in self.intake_counters.values():
            totals.update(counters)
        return dict(totals)

    def _send(self, connection: Connection, message: Any) -> bool:
        try:
            connection.send(message)
            return True
        except (OSError, ValueError):  # that front end is gone: the next wait sees it
            return False


@contextlib.contextmanager
def core_environment() -> Iterator[None]:
    """The environment the core process starts with: OpenMP threads that sleep when idle rather than spin
    (unless the caller chose a policy). The core and its front end share the machine's cores; a spinning
    thread pool in one process takes them from the other (on 2 cores, steps ran several times slower)."""
    chosen = os.environ.get("OMP_WAIT_POLICY")
    if chosen is None:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        if chosen is None:
            os.environ.pop("OMP_WAIT_POLICY", None)


def _strip(output: RequestOutput) -> None:
    """The prompt and its token ids stay behind: the front end has them (an output is made every step)."""
    output.prompt = None
    output.prompt_token_ids = []


def picklable(err: BaseException) -> BaseException:
    """The error itself when it crosses a pipe intact, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__}: {err}")
