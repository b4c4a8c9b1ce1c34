"""How the one-process `mmengine serve` ends on Ctrl-C: exit code 0, the engine's processes (preprocessing workers)
stopped before the server's own process is gone, and no interpreter teardown after the app's shutdown (whose
Triton nanobind leak report printed ~30 lines on every Ctrl-C)."""

from __future__ import annotations

import asyncio
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx
import psutil
from helpers import alive, wait_until
from serve_helpers import data_url, image_part

from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.testing import make_test_image

_RUNNING = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+)")  # the port bound before the model loaded


def test_ctrl_c_stops_the_workers_first_and_exits_0_without_a_teardown(checkpoint_dir):
    command = [sys.executable, "-m", "mmengine", "serve", "--model", str(checkpoint_dir()), "--port", "0",
               "--served-model-name", "tiny", "--max-model-len", "256", "--dtype", "float32", "--device", "cpu",
               "--mm-processor-workers", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    urls: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if match := _RUNNING.search(line):
                urls.put(match.group(1))
        urls.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    workers: list[psutil.Process] = []
    try:
        base_url = urls.get(timeout=300)  # a bound for a hang only: torch's import on a loaded 2-core machine
        assert base_url is not None, "".join(lines)
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
            image_part(data_url(make_test_image(1, size=(64, 48)))), {"type": "text", "text": "Describe it."}]}]}
        assert httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        workers = [child for child in psutil.Process(process.pid).children()
                   if "spawn_main" in " ".join(child.cmdline())]
        assert len(workers) == 1  # the preprocessing worker (the picture above went through it)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert not any(alive(worker.pid) for worker in workers)  # stopped by the app's shutdown, not left to notice
        reader.join(timeout=10)
        output = "".join(lines)
        assert "Application shutdown complete" in output
        assert "nanobind" not in output and "leaked" not in output, output[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for worker in workers:
            if alive(worker.pid):
                worker.kill()
        assert wait_until(lambda: not any(alive(worker.pid) for worker in workers), timeout_s=10)


def test_an_engine_from_model_is_the_async_engines_to_stop(checkpoint_dir):
    """AsyncMMEngine.from_model builds the engine, so its shutdown() stops the engine's worker processes (before,
    only an engine-core client was; an in-process engine's workers waited for the interpreter's exit)."""
    async_engine = AsyncMMEngine.from_model(str(checkpoint_dir()), max_model_len=256, dtype="float32", device="cpu",
                                            mm_processor_workers=1)
    pool = async_engine.engine.input_processor.pool
    assert pool is not None and pool.wait_until_started(timeout=300)
    workers = [psutil.Process(pid) for pid in pool.worker_pids()]
    assert len(workers) == 1 and alive(workers[0].pid)
    asyncio.run(async_engine.shutdown())
    assert async_engine.engine.input_processor.pool is None
    assert not alive(workers[0].pid)

