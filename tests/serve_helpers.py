"""A real server for tests: uvicorn in a background thread on a free loopback port, plus helpers to
send images and read /metrics."""

from __future__ import annotations

import base64
import contextlib
import io
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import PIL.Image
import uvicorn

from mmengine import MMEngine
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings, build_app

MODEL_NAME = "tiny-llava"
API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Answers are compared with an offline engine's: both pinned to CPU fp32, where a request's tokens do
# not depend on what else is in its batch (on a GPU the kernels change with the batch shape).
CPU_FP32 = {"max_model_len": 512, "device": "cpu", "dtype": "float32"}


@dataclass
class RunningServer:
    base_url: str
    async_engine: AsyncMMEngine

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.base_url + "/metrics", timeout=30).text)

    def wait_until_idle(self, timeout_s: float = 30.0, until=None) -> dict[str, float]:
        """Polls /metrics until no request is in flight or in the engine and `until(metrics)` holds
        (bounded); returns the last scrape. `until` names the outcome to wait for: a request the server
        has received but not yet queued (its prompt still being prepared) is not in flight yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.metrics()
            idle = (metrics["mmengine_requests_in_flight"] == 0 and metrics["mmengine_requests_running"] == 0
                    and metrics["mmengine_requests_waiting"] == 0)
            if (idle and (until is None or until(metrics))) or time.monotonic() > deadline:
                return metrics
            time.sleep(0.05)


@contextlib.contextmanager
def running_server(async_engine: AsyncMMEngine, settings: ServerSettings) -> Iterator[RunningServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(async_engine, settings), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="test-uvicorn")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", async_engine)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@contextlib.contextmanager
def reference_server(path) -> Iterator[tuple[MMEngine, RunningServer, openai.OpenAI]]:
    """The tiny model in fp32 on the CPU (the precision transformers' reference runs in) behind a server,
    and an openai client for it."""
    engine = MMEngine(str(path), max_model_len=256, device="cpu", dtype="float32")
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as running:
        yield engine, running, openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)


def data_url(image: PIL.Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name (with labels, if any): value}; counters keep their `_total`."""
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


@contextlib.contextmanager
def keyed_server(path) -> Iterator[RunningServer]:
    """The tiny model (CPU_FP32) behind a server that asks for API_KEY."""
    engine = MMEngine(str(path), **CPU_FP32)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME, api_key=API_KEY)) as running:
        yield running
