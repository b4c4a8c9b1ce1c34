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


def _chat(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_a_dead_engine_drains_then_stops_the_server(checkpoint_dir, monkeypatch):
    monkeypatch.setattr(api_server, "DEAD_ENGINE_DRAIN_SECONDS", 1.0)
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
        thread.join(timeout=15)
        assert not thread.is_alive() and result == [1]
    finally:
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
