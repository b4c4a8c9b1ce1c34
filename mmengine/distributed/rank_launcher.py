"""Where the worker processes come from: forked from a launcher process that has imported what a rank runs (torch,
transformers, the model code: seconds of CPU an interpreter) once, rather than spawned, each importing it all again.

```
driver --(first executor: start)--> launcher (multiprocessing's fork server, ours alone: imports `preload` once)
       --(each rank: fds, pickled process)--> launcher --fork--> rank (the imports already done; sys.path, cwd and
                                                                  the driver's environment as a spawned one's)
```

At tensor_parallel_size N that is one interpreter's imports instead of N, and none for a second engine started while
the first still runs. The launcher never runs torch (CUDA included: importing torch does not initialize it), so a
rank forked from it starts as clean as a spawned one and sets up its own GPU. It lives while any executor of this
process does: the last one to stop stops it (no process is left behind), and it leaves by itself when the driver dies.
"""

from __future__ import annotations

import io
import os
import signal
import threading
from collections.abc import Iterable
from multiprocessing import forkserver, popen_forkserver, process, spawn, util
from multiprocessing.context import reduction, set_spawning_popen
from typing import Any


class Launcher:
    """The fork server and how many executors use it."""

    def __init__(self, preload: list[str]) -> None:
        self.server = forkserver.ForkServer()
        self.server.set_forkserver_preload(["__main__", *preload])  # (__main__: as a spawned rank imports it)
        self.users = 0


_lock = threading.Lock()
_launcher: Launcher | None = None


def acquire(preload: Iterable[str]) -> int:
    """One more executor forks its ranks from the launcher (started now, importing `preload`, if none runs); its pid."""
    global _launcher
    with _lock:
        if _launcher is None:
            _launcher = Launcher(list(dict.fromkeys(preload)))
        _launcher.server.ensure_running()
        _launcher.users += 1
        return _launcher.server._forkserver_pid


def release() -> None:
    """An executor whose ranks have all exited: the last one stops the launcher."""
    global _launcher
    with _lock:
        if _launcher is None:
            return
        _launcher.users -= 1
        if _launcher.users > 0:
            return
        launcher, _launcher = _launcher, None
    stop_server(launcher.server)


def stop_server(server: forkserver.ForkServer) -> None:
    """Stops the launcher once no executor needs it: killed, as a worker leaves (worker_loop.leave), since its exit
    would run the interpreter's teardown with torch loaded (seconds of CPU) for nothing; and reaped."""
    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = server._forkserver_pid = None
        address, server._forkserver_address = server._forkserver_address, None
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    if address is not None and not util.is_abstract_socket_namespace(address):
        try:
            os.unlink(address)
        except FileNotFoundError:
            pass


class LaunchedPopen(popen_forkserver.Popen):
    """popen_forkserver.Popen over our launcher rather than multiprocessing's shared fork server (which another
    library may use, with other modules preloaded, and which lives as long as the process)."""

    def _launch(self, process_obj: Any) -> None:
        if _launcher is None:
            raise RuntimeError("no rank launcher: acquire() it before starting a worker process")
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = _launcher.server.connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's sentinel of this process (as popen_forkserver keeps it)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class LaunchedProcess(process.BaseProcess):
    """A worker process forked from the launcher (`acquire` first)."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: Any) -> LaunchedPopen:
        return LaunchedPopen(process_obj)
