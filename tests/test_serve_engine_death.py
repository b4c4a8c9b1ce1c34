"""The one-process server fails fast when its engine dies for good (a tensor-parallel worker or an
engine-core process died, the step loop failed): it answers 503 while draining, then stops and
run_server exits with code 1, so a supervisor restarts it; a deliberate stop returns 0."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import uvicorn

from mmengine import MMEngine
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints import api_server
from mmengine.entrypoints.api_server import ServerSettings, build_app, serve_until_engine_dies
from mmengine.errors import EngineDeadError

MODEL = "tiny"


def _serve(async_engine: AsyncMMEngine):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(async_engine, ServerSettings(MODEL)), log_level="warning"))
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(
        serve_until_engine_dies(server, async_engine, poll_seconds=0.05, sockets=[sock]))), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return server, thread, result, f"http://127.0.0.1:{sock.getsockname()[1]}", sock


class _HeldDrain:
    """api_server's asyncio, but for the dead engine's drain (the sleep of DEAD_ENGINE_DRAIN_SECONDS), which lasts
    until `checked` is set: the test's answers land in the drain whatever the machine's load. (A timed 1 s drain
    was used up to 0.76 s by the three requests that follow the death, on a loaded 2-core machine.)"""

    def __init__(self) -> None:
        self.started, self.checked = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(asyncio, name)

    async def sleep(self, delay: float, result=None):
        if delay != api_server.DEAD_ENGINE_DRAIN_SECONDS:
            return await asyncio.sleep(delay, result)
        self.started.set()
        await asyncio.to_thread(self.checked.wait, 60)  # a bound for a test that failed before it set `checked`
        return result


def _chat(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_a_dead_engine_drains_then_stops_the_server(checkpoint_dir, monkeypatch):
    drain = _HeldDrain()
    monkeypatch.setattr(api_server, "asyncio", drain)
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, device="cpu", dtype="float32")
    async_engine = AsyncMMEngine(engine)
    server, thread, result, base, sock = _serve(async_engine)
    try:
        assert _chat(base).status_code == 200 and not async_engine.has_died

        def worker_died() -> None:
            raise EngineDeadError("tensor-parallel rank 1 (pid 4242) died")

        monkeypatch.setattr(engine, "step", worker_died)
        assert _chat(base).status_code == 503  # the request in flight
        assert async_engine.has_died
        assert httpx.get(base + "/health", timeout=5).status_code == 503  # draining
        assert _chat(base).status_code == 503
        assert drain.started.wait(15) and thread.is_alive()  # the server is draining: it stops once the drain ends
        drain.checked.set()
        thread.join(timeout=15)
        assert not thread.is_alive() and result == [1]
    finally:
        drain.checked.set()
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        asyncio.run(async_engine.shutdown())


def test_a_deliberate_stop_is_not_a_death(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, device="cpu", dtype="float32")
    async_engine = AsyncMMEngine(engine)
    server, thread, result, base, sock = _serve(async_engine)
    try:
        assert _chat(base).status_code == 200
        server.should_exit = True
        thread.join(timeout=15)
        assert result == [0] and not async_engine.has_died
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        asyncio.run(async_engine.shutdown())
