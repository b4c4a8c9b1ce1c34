"""`mmengine serve --api-server-count N`: N front-end processes and one engine-core process, as vLLM v1 lays
them out.

```
              clients (HTTP)
                    |
     one listening socket, bound here, shared by the front ends (the kernel hands each connection to one)
        |                     |
  front end 0   ...     front end N-1      HTTP, request parsing, media fetching and decoding, chat
  (uvicorn + AsyncMMEngine over an          templates, tokenizing, preprocessing (threads, or
   EngineCoreClient)                        --mm-processor-workers processes each), SSE
        |                     |
        +-- unix socket: token ids, params, pixel tensors by fd (shared memory), outputs --+
                                     |
                              engine core                scheduler, encoder cache, prefix cache, model,
                                                          detokenizer (engine/core_process.py)
```

This process (the launcher) binds the socket, spawns the core and the front ends, and watches them:
- a core that dies makes every front end answer 503 (`engine_dead`) and /health go red at once; the
  launcher gives them a moment to say so, then stops the front ends and exits non-zero;
- a front end that dies brings the server down cleanly: the others stop, the core stops, exit non-zero;
- SIGINT / SIGTERM stop everything (exit 0); front ends and the core exit when the launcher is gone.

The core and the front ends leave without the interpreter's teardown once they have stopped (as tensor-parallel
workers do, which leave when the core goes): with torch loaded it took seconds on a busy 2-core machine (2 to 14 s
the core, which a front end's shutdown waits for, then 5 to 10 s a front end), and what they hold is released by then.

/metrics on any front end covers every process: counters and histograms through prometheus-client's
multiprocess mode (in the run directory this launcher makes, with the core's socket), the core's stats() by a call,
with the intake counters summed over the front ends.

The run directory is removed by whichever leaves last: the launcher once it has stopped everything, or, when the
launcher was killed, the core once its front ends have left (it serves them until then, ORPHANED_SERVE_SECONDS at
most).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

# the launcher imports no engine module (torch, transformers, the model code): it spawns the processes that do
from mmengine.engine.core_process import FAILED, READY, core_environment, core_main, picklable
from mmengine.entrypoints.listening_socket import listening_socket
from mmengine.entrypoints.server_settings import ServerSettings
from mmengine.errors import ConfigError, EngineDeadError
from mmengine.utils.collector_pace import pace_collector_for_serving
from mmengine.utils.heap import freeze_startup_heap
from mmengine.utils.process_exit import leave

logger = logging.getLogger(__name__)

SERVING = "serving"
DRAIN_SECONDS = 2.0  # after the core dies: front ends answer 503 for this long before they are stopped
_STOP_SECONDS = 10.0
_JOIN_SECONDS = 5.0


@dataclass
class FrontEndSpec:
    """What each front-end process builds (plain data: it crosses to the spawned process)."""

    model: str
    engine_options: dict[str, Any]
    settings: ServerSettings
    max_queued_requests: int | None = None
    num_preprocess_workers: int = 2
    max_admission_wait_s: float = 0.0
    log_level: str = "info"
    access_log: bool = True  # uvicorn's line per request


@dataclass
class _Child:
    name: str
    process: Any
    connection: Connection  # ours: the child's notices come here; the child sees EOF when we are gone
    pid: int = field(init=False)

    def __post_init__(self) -> None:
        self.pid = self.process.pid


class ServerProcesses:
    """One engine core and `api_server_count` front ends on one port. `start()` returns once every front end
    serves; `wait()` watches them until one dies or `stop()` is called, and returns the exit code."""

    def __init__(self, spec: FrontEndSpec, api_server_count: int, host: str, port: int) -> None:
        if not isinstance(api_server_count, int) or api_server_count < 2:
            raise ConfigError(f"api_server_count must be an int >= 2 here (1 serves in one process), got {api_server_count!r}")
        self.spec = spec
        self.api_server_count = api_server_count
        self.host, self.port = host, port
        self.core: _Child | None = None
        self.front_ends: list[_Child] = []
        self._socket: socket.socket | None = None
        self._directory: Path | None = None
        self._stopping = threading.Event()
        self._exit_code: int | None = None

    @property
    def core_address(self) -> str:
        return str(self._directory / "core.sock")

    @property
    def core_authkey(self) -> bytes:
        return self._authkey

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- start ---------------------------------------------------------------------

    def start(self) -> ServerProcesses:
        self._socket = listening_socket(self.host, self.port)
        self.port = self._socket.getsockname()[1]
        self._directory = Path(tempfile.mkdtemp(prefix="mmengine-serve-"))
        self._authkey = secrets.token_bytes(32)
        metrics_directory = self._directory / "metrics"
        metrics_directory.mkdir()
        context = multiprocessing.get_context("spawn")
        try:
            core_options = {**self.spec.engine_options, "engine_core": "thread", "mm_processor_workers": 0}
            self.core = self._spawn(context, "mmengine-engine-core", core_process_main, (self.spec.model, core_options),
                                    (self.core_address, self._authkey, str(self._directory)))
            front_end_options = {**self.spec.engine_options, "engine_core": "process"}
            spec = FrontEndSpec(**{**self.spec.__dict__, "engine_options": front_end_options,
                                   "max_queued_requests": per_front_end_limit(self.spec.max_queued_requests, self.api_server_count)})
            previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_directory)
            try:
                for index in range(self.api_server_count):
                    self.front_ends.append(self._spawn(context, f"mmengine-front-end-{index}", front_end_main,
                                                       (index, spec, self._socket), (self.core_address, self._authkey)))
            finally:
                if previous is None:
                    os.environ.pop("PROMETHEUS_MULTIPROC_DIR")
                else:
                    os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
            self._wait_until_serving()
        except BaseException:
            self.stop()
            raise
        logger.info("serving %s as %r on %s: %d front ends (pids %s), engine core pid %d", self.spec.model,
                    self.spec.settings.served_model_name, self.base_url, len(self.front_ends),
                    ", ".join(str(child.pid) for child in self.front_ends), self.core.pid)
        return self

    def _spawn(self, context: Any, name: str, target: Any, head: tuple, tail: tuple) -> _Child:
        ours, theirs = context.Pipe()
        process = context.Process(target=target, args=(*head, theirs, *tail), name=name, daemon=False)
        with core_environment():
            process.start()
        theirs.close()
        return _Child(name, process, ours)

    def _wait_until_serving(self) -> None:
        """Until the core is ready and every front end serves; a child that fails or dies first raises."""
        waiting = {child.connection: child for child in [self.core, *self.front_ends]}
        while waiting:
            ready = wait([*waiting, *(child.process.sentinel for child in waiting.values())])
            for connection in [item for item in ready if item in waiting]:  # a message first: it may say why
                child = waiting.pop(connection)
                try:
                    status, payload = connection.recv()
                except (EOFError, OSError):
                    self._raise_failed(child)
                if status == FAILED:
                    raise payload
                if status not in (READY, SERVING):
                    raise EngineDeadError(f"{child.name} said {status!r} while starting")
            for child in list(waiting.values()):
                if child.process.sentinel in ready:
                    self._raise_failed(child)

    def _raise_failed(self, child: _Child) -> None:
        child.process.join(_JOIN_SECONDS)
        raise EngineDeadError(f"{child.name} (pid {child.pid}) died while starting (exit code {child.process.exitcode})")

    # -- watch -----------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> int | None:
        """Watches the processes until one exits or `stop()` is called; then brings the server down and
        returns the exit code (0: stopped, 1: a process died). None if `timeout` passed first."""
        if self._exit_code is not None:
            return self._exit_code
        deadline = None if timeout is None else time.monotonic() + timeout
        sentinels = {child.process.sentinel: child for child in [self.core, *self.front_ends]}
        while not self._stopping.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            ready = wait(list(sentinels), timeout=0.2 if left is None else min(0.2, left))
            if not ready or self._stopping.is_set():  # (a terminal's Ctrl-C stops the front ends too, maybe first)
                continue
            child = sentinels[ready[0]]
            child.process.join(_JOIN_SECONDS)
            if child is self.core:
                logger.error("the engine core (pid %d) died (exit code %s): every front end answers 503 for %.0f s, "
                             "then the server exits", child.pid, child.process.exitcode, DRAIN_SECONDS)
                time.sleep(DRAIN_SECONDS)
            else:
                logger.error("%s (pid %d) died (exit code %s): stopping the server", child.name, child.pid,
                             child.process.exitcode)
            self.stop(exit_code=1)
            return 1
        self.stop()
        return self._exit_code

    def request_stop(self) -> None:
        """From a signal handler or another thread: `wait()` brings the server down and returns 0."""
        self._stopping.set()

    def stop(self, exit_code: int = 0) -> None:
        """Stops the front ends (SIGTERM: uvicorn finishes its answers), then the core; idempotent."""
        if self._exit_code is not None:
            return
        self._exit_code = exit_code
        self._stopping.set()
        for child in self.front_ends:
            if child.process.is_alive():
                child.process.terminate()
        for child in self.front_ends:
            _join_or_kill(child.process, _STOP_SECONDS)
            child.connection.close()
        if self.core is not None:
            try:
                self.core.connection.send(None)
            except (OSError, ValueError):
                pass
            _join_or_kill(self.core.process, _STOP_SECONDS)
            self.core.connection.close()
        if self._socket is not None:
            self._socket.close()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> ServerProcesses:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class _TerminatedWhileStarting(Exception):
    """SIGTERM while the processes start."""


def _terminated_while_starting(*_: object) -> None:
    raise _TerminatedWhileStarting


def run_server_processes(spec: FrontEndSpec, api_server_count: int, host: str, port: int) -> int:
    """`mmengine serve --api-server-count N`: serves until SIGINT / SIGTERM (exit code 0) or until a process
    dies (1). SIGINT or SIGTERM while the model loads stops what has started (SIGTERM's default would leave
    the front ends waiting minutes for a core that never listens)."""
    server = ServerProcesses(spec, api_server_count, host, port)
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminated_while_starting)}
    try:
        try:
            server.start()  # Ctrl-C while the model loads interrupts it (and stops what has started)
        except _TerminatedWhileStarting:
            return 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.signal(sig, lambda *_: server.request_stop())
            previous.setdefault(sig, handler)
        return server.wait()
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _join_or_kill(process: Any, seconds: float) -> None:
    process.join(seconds)
    if process.is_alive():
        process.kill()
        process.join(_JOIN_SECONDS)


def per_front_end_limit(limit: int | None, count: int) -> int | None:
    """A server-wide --max-queued-requests split among the front ends (each admits its share)."""
    return None if limit is None else max(1, math.ceil(limit / count))


# -- the front-end process ---------------------------------------------------------------


def front_end_main(index: int, spec: FrontEndSpec, sock: socket.socket, launcher: Connection, core_address: str,
                   core_authkey: bytes) -> None:
    """One front end: an AsyncMMEngine over the shared core, served by uvicorn on the launcher's socket.
    It says SERVING once uvicorn listens, and stops (as on SIGTERM) when the launcher is gone."""
    import uvicorn

    from mmengine.engine.async_engine import AsyncMMEngine
    from mmengine.engine.core_client import EngineCoreClient
    from mmengine.entrypoints.api_server import build_app, signals_stop

    logging.basicConfig(level=spec.log_level.upper(), format=f"%(asctime)s %(levelname)s front-end-{index} %(name)s: %(message)s")
    serving = threading.Event()
    threading.Thread(target=leave_if_launcher_goes_while_starting, args=(launcher, serving), name="mmengine-launcher-watch",
                     daemon=True).start()
    try:
        client = EngineCoreClient(spec.model, core_address=core_address, core_authkey=core_authkey, **spec.engine_options)
        async_engine = AsyncMMEngine(client, max_queued_requests=spec.max_queued_requests,
                                     num_preprocess_workers=spec.num_preprocess_workers, owns_engine=True,
                                     max_admission_wait_s=spec.max_admission_wait_s)
    except BaseException as err:  # noqa: BLE001 - the launcher reports it
        launcher.send((FAILED, picklable(err)))
        return
    server = uvicorn.Server(uvicorn.Config(build_app(async_engine, spec.settings), log_level=spec.log_level,
                                           access_log=spec.access_log, timeout_graceful_shutdown=5))
    threading.Thread(target=_tell_launcher, args=(server, launcher, serving), name="mmengine-launcher-link",
                     daemon=True).start()
    freeze_startup_heap()
    pace_collector_for_serving()
    with signals_stop(server):  # a terminal's Ctrl-C reaches every front end too: it stops, without a traceback
        server.run(sockets=[sock])  # until stopped: its shutdown has closed the engine's client and worker pool
    leave()


def core_process_main(model: str, options: dict[str, Any], launcher: Connection, address: str, authkey: bytes,
                      run_directory: str) -> None:
    """The engine-core process (engine/core_process.py's core_main), left without the interpreter's teardown once
    the launcher has told it to stop or is gone. A core that raises exits as a spawned process does (its traceback,
    code 1), and the launcher cleans up after it.

    Its run directory (its socket, the front ends' metrics files) goes with it, for a launcher killed with SIGKILL
    removes nothing: core_main returns once the front ends are stopped (by the launcher, or on their own when the
    launcher is gone; then they have left, or had ORPHANED_SERVE_SECONDS), or when the engine could not be built
    (the launcher then stops the front ends still starting)."""
    core_main(model, options, launcher, address, authkey)
    shutil.rmtree(run_directory, ignore_errors=True)
    leave()


def leave_if_launcher_goes_while_starting(launcher: Connection, serving: threading.Event,
                                          leave: Any = os._exit) -> None:
    """Until this front end serves, a launcher that is gone (killed while the model loads: its core may never
    listen, and connecting to it would wait minutes) ends it at once, exit code 1. The launcher never writes to
    a front end, so its end turns readable only when it closes."""
    wait([launcher])
    if not serving.is_set():
        leave(1)


def _tell_launcher(server: Any, launcher: Connection, serving: threading.Event) -> None:
    """Says SERVING once uvicorn has started; then waits for the launcher's end to close (it died) and stops
    this front end as SIGTERM would."""
    while not server.started and not server.should_exit:
        time.sleep(0.02)
    serving.set()
    try:
        launcher.send((SERVING, os.getpid()))
        launcher.recv()
    except (EOFError, OSError):
        pass
    server.should_exit = True
