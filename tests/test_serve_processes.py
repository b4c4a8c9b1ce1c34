"""`mmengine serve --api-server-count N` (entrypoints/server_processes.py): N front-end processes on one port and
one engine-core process. The answers of the one-process server; one encoder cache whichever front end took a
picture; /metrics summing every front end; a client that disconnects aborts its request in the core; a dead
core makes every front end answer 503 and the server exit non-zero; a dead front end or launcher brings the
whole server down; no process left behind."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass, field

import httpx
import pytest
from helpers import alive, shm_files_made_by, wait_until
from serve_helpers import data_url, image_part, parse_metrics, reference_server

from mmengine import SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.engine.core_client import EngineCoreClient
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.entrypoints.server_processes import FrontEndSpec, ServerProcesses
from mmengine.testing import make_test_image

MODEL = "tiny-llava"
OPTIONS = {"max_model_len": 256, "dtype": "float32", "device": "cpu"}
LLAVA_PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"


def chat(picture_seeds: list[int], max_tokens: int = 6, text: str = "Describe it.") -> dict:
    parts = [image_part(data_url(make_test_image(seed, size=(64 + 8 * seed, 48)))) for seed in picture_seeds]
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def post(base_url: str, body: dict) -> httpx.Response:
    with httpx.Client(timeout=60) as client:  # a connection of its own: the kernel picks the front end
        return client.post(base_url + "/v1/chat/completions", json=body)


def start(path, count: int = 2) -> ServerProcesses:
    return ServerProcesses(FrontEndSpec(str(path), OPTIONS, ServerSettings(MODEL), log_level="warning"),
                           count, "127.0.0.1", 0).start()


@pytest.fixture(scope="module")
def llava(checkpoint_dir):
    return checkpoint_dir()


@pytest.fixture(scope="module")
def server(llava):
    server = start(llava)
    pids = [server.core.pid, *(child.pid for child in server.front_ends)]
    assert all(alive(pid) for pid in pids)
    yield server
    server.request_stop()
    assert server.wait(timeout=30) == 0  # stopped, not died
    assert not any(alive(pid) for pid in pids)


def test_the_front_ends_answer_as_the_one_process_server_and_metrics_sum_them(server, llava):
    bodies = [chat([1]), chat([2, 3], 8), chat([1], 5, "What colour?"), chat([], 7, "Tell me a story.")] * 2
    before = parse_metrics(httpx.get(server.base_url + "/metrics").text)

    async def send_all():
        async def one(body):
            async with httpx.AsyncClient(timeout=60) as client:  # new connections: both front ends take some
                return await client.post(server.base_url + "/v1/chat/completions", json=body)
        return await asyncio.gather(*(one(body) for body in bodies))

    answers = asyncio.run(send_all())
    with reference_server(llava) as (_, reference, _):
        want = [httpx.post(reference.v1 + "/chat/completions", json=body, timeout=60).json() for body in bodies]
    for answer, expected in zip(answers, want):
        assert answer.status_code == 200
        got = answer.json()
        assert got["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        for field in ("prompt_tokens", "completion_tokens"):  # cached_tokens depends on the order requests ran
            assert got["usage"][field] == expected["usage"][field]
    scrapes = [parse_metrics(httpx.get(server.base_url + "/metrics").text) for _ in range(4)]  # any front end
    key = 'mmengine_api_requests_total{endpoint="chat",finish_reason="length"}'
    for after in scrapes:
        assert after[key] - before.get(key, 0) == len(bodies)  # every front end's counter, summed
        assert after["mmengine_time_to_first_token_seconds_count"] - before.get("mmengine_time_to_first_token_seconds_count", 0) == len(bodies)
        assert after["mmengine_requests_in_flight"] == 0
        assert after["mmengine_encoder_runs_total"] - before.get("mmengine_encoder_runs_total", 0) == 3  # pictures 1, 2, 3
        assert after["mmengine_images_decoded_total"] - before["mmengine_images_decoded_total"] >= 3


def test_a_picture_is_encoded_once_whichever_front_end_took_it(server):
    """Two more front ends (in this process) join the server's core: the same picture through each is one
    encoder run, decoded once in each front end; stats() sums the front ends' intake counters."""
    picture = make_test_image(40, size=(80, 64))
    params = SamplingParams(max_tokens=4, temperature=0)

    async def through(client: EngineCoreClient, prompt: str) -> list[int]:
        async with AsyncMMEngine(client) as async_engine:
            stream = await async_engine.add_request(prompt, [picture], params)
            return [token for delta in [d async for d in stream] for token in delta.token_ids]

    first = EngineCoreClient(server.spec.model, core_address=server.core_address, core_authkey=server.core_authkey, **OPTIONS)
    second = EngineCoreClient(server.spec.model, core_address=server.core_address, core_authkey=server.core_authkey, **OPTIONS)
    try:
        before = first.stats()
        # the picture at a different place in each prompt: no prefix hit spares the encoder the second time
        tokens = [asyncio.run(through(first, LLAVA_PROMPT)),
                  asyncio.run(through(second, "USER: Look closely.\n<image>\nWhat is it? ASSISTANT:"))]
        after = second.stats()
    finally:
        first.close()
        second.close()
    assert len(tokens[0]) == len(tokens[1]) == 4
    assert after["encoder_runs"] - before["encoder_runs"] == 1
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] >= 1
    assert after["images_decoded"] - before["images_decoded"] == 2  # one in each front end, both counted
    assert httpx.get(server.base_url + "/health").status_code == 200  # the server's own front ends serve on


def shared_segments(pid: int) -> int:
    """The descriptors a process holds on shared-memory segments (torch shares tensors by such descriptors)."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    return sum("/dev/shm/" in link or link.startswith("/memfd:") for link in links)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads descriptors from /proc (Linux)")
def test_front_ends_and_core_hold_no_descriptor_per_picture(server):
    """New pictures through both front ends, their processor caches on: no process holds a shared segment
    per picture (a cached picture sent in place would keep its segment open), nor is a file of theirs left in /dev/shm."""
    pids = [server.core.pid, *(child.pid for child in server.front_ends)]
    assert post(server.base_url, chat([70])).status_code == 200
    before = {pid: shared_segments(pid) for pid in pids}
    files = shm_files_made_by(pids)  # theirs: other processes' files come and go in /dev/shm meanwhile

    async def send_all():
        async def one(seed):
            async with httpx.AsyncClient(timeout=60) as client:
                return await client.post(server.base_url + "/v1/chat/completions", json=chat([seed], 1))
        return await asyncio.gather(*(one(100 + i) for i in range(30)))

    assert all(answer.status_code == 200 for answer in asyncio.run(send_all()))
    after = {pid: shared_segments(pid) for pid in pids}
    assert all(after[pid] - before[pid] < 3 for pid in pids), (before, after)
    assert shm_files_made_by(pids) <= files


def test_a_wrong_key_does_not_join_the_core(server):
    with pytest.raises(Exception, match="digest|auth|closed|reset"):
        EngineCoreClient(server.spec.model, core_address=server.core_address, core_authkey=b"wrong", **OPTIONS)
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_a_client_that_disconnects_aborts_its_request_in_the_core(server):
    before = parse_metrics(httpx.get(server.base_url + "/metrics").text)
    body = {**chat([5], 200), "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", server.base_url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
    scrapes = []

    def settled() -> bool:
        scrapes.append(after := parse_metrics(httpx.get(server.base_url + "/metrics").text))
        return (after["mmengine_requests_running"] == after["mmengine_requests_waiting"] == 0
                and after["mmengine_client_disconnects_total"] > before.get("mmengine_client_disconnects_total", 0))

    wait_until(settled, timeout_s=30)
    after = scrapes[-1]
    assert after["mmengine_client_disconnects_total"] - before.get("mmengine_client_disconnects_total", 0) == 1
    assert after["mmengine_requests_running"] == 0 and after["mmengine_kv_blocks_free"] == after["mmengine_kv_blocks_total"]
    assert after["mmengine_generation_tokens_total"] - before["mmengine_generation_tokens_total"] < 200


def test_a_dead_core_makes_every_front_end_answer_503_and_the_server_exit_non_zero(llava):
    server = start(llava)
    pids = [server.core.pid, *(child.pid for child in server.front_ends)]
    try:
        assert post(server.base_url, chat([], 2)).status_code == 200
        os.kill(server.core.pid, signal.SIGKILL)
        killed = time.monotonic()
        # the front ends notice within their poll of the core (bounded here: a loaded machine can lag a step)
        wait_until(lambda: httpx.get(server.base_url + "/health", timeout=10).status_code == 503, timeout_s=10)
        health = [httpx.get(server.base_url + "/health", timeout=10) for _ in range(6)]  # new connections each
        answers = [post(server.base_url, chat([], 2)) for _ in range(4)]
        assert all(reply.status_code == 503 for reply in health + answers)
        assert all(reply.json()["error"]["code"] == "engine_dead" for reply in health + answers)
        assert server.wait(timeout=30) == 1
        assert time.monotonic() - killed < 25  # bounded: the drain, then the front ends' stop (never a hang)
    finally:
        server.stop()
    assert not any(alive(pid) for pid in pids)


def test_a_front_end_that_gets_ctrl_c_stops_cleanly(llava):
    """A terminal's Ctrl-C reaches the front ends as well as the launcher: a front end stops as on SIGTERM, exit code 0.
    uvicorn raised the SIGINT it had caught again once stopped, into asyncio's handler: a KeyboardInterrupt traceback
    and exit code 1, or, when it came before the launcher's own stop, a server that said a front end had died."""
    server = start(llava)
    front_end = server.front_ends[0]
    try:
        assert post(server.base_url, chat([], 2)).status_code == 200
        os.kill(front_end.pid, signal.SIGINT)
        front_end.process.join(30)
        assert front_end.process.exitcode == 0
        assert server.wait(timeout=30) == 1  # alone (not with the launcher), it is a front end gone: the server stops
    finally:
        server.stop()
    assert not any(alive(pid) for pid in [server.core.pid, *(child.pid for child in server.front_ends)])


_SERVING = re.compile(r"on (http://127\.0\.0\.1:\d+): 2 front ends \(pids (\d+), (\d+)\), engine core pid (\d+)")


def serve_command(path, *flags: str, temp_dir=None) -> subprocess.Popen:
    """The server in a subprocess (its temporary files under `temp_dir` when given); its log (stderr, and uvicorn's
    access log on stdout) comes on one pipe."""
    command = [sys.executable, "-m", "mmengine", "serve", "--model", str(path), "--api-server-count", "2",
               "--port", "0", "--served-model-name", MODEL, "--max-model-len", "256", "--dtype", "float32",
               "--device", "cpu", *flags]
    env = None if temp_dir is None else {**os.environ, "TMPDIR": str(temp_dir)}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@dataclass
class ServerLog:
    lines: list[str] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)  # every process writing it is gone


def wait_for_serving(process: subprocess.Popen, timeout_s: float = 300,
                     log: ServerLog | None = None) -> tuple[str, list[int]]:
    """The server's URL and pids from its log line; its log is drained from then on (a full pipe would block it),
    into `log` when given. A server that exits first is seen at once (its log ends); the bound is for a hang only:
    three interpreters importing torch took 80 s to serve on a 2-core machine under load."""
    found: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            if log is not None:
                log.lines.append(line)
            match = _SERVING.search(line)
            if match:
                found.put((match.group(1), [int(match.group(i)) for i in (2, 3, 4)]))
        found.put(None)
        if log is not None:
            log.ended.set()

    threading.Thread(target=read, daemon=True).start()
    serving = found.get(timeout=timeout_s)
    if serving is None:
        raise AssertionError(f"the server exited before serving (exit code {process.wait()})")
    return serving


_ACCESS_LINE = '"POST /v1/chat/completions HTTP/1.1" 200'


@pytest.mark.parametrize("victim", ["front end", "launcher"])
def test_a_dead_front_end_or_launcher_brings_the_whole_server_down(llava, victim, tmp_path):
    """`mmengine serve --api-server-count 2`: one front end killed -> the server exits with code 1 and stops the
    rest; the launcher killed -> its front ends and core exit on their own (no orphans). Either way the run
    directory (the core's socket, the metrics files) is removed: by the launcher, or by the core after its front
    ends when the launcher was killed. Uvicorn's access log: a line per request, none with
    --disable-uvicorn-access-log (the launcher case runs with it)."""
    flags = ["--disable-uvicorn-access-log"] if victim == "launcher" else []
    process = serve_command(llava, *flags, temp_dir=tmp_path)
    pids: list[int] = []
    log = ServerLog()
    try:
        base_url, pids = wait_for_serving(process, log=log)
        assert len(list(tmp_path.glob("mmengine-serve-*"))) == 1  # the launcher's run directory, while serving
        assert post(base_url, chat([7], 3)).status_code == 200
        if not flags:
            assert wait_until(lambda: any(_ACCESS_LINE in line for line in log.lines))
        os.kill(pids[0] if victim == "front end" else process.pid, signal.SIGKILL)
        killed = time.monotonic()
        code = process.wait(timeout=30)
        assert code == (1 if victim == "front end" else -signal.SIGKILL)
        assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s=20)
        assert time.monotonic() - killed < 20
        assert wait_until(lambda: not list(tmp_path.glob("mmengine-serve-*")), timeout_s=5)
        if flags:
            assert log.ended.wait(10)  # every process writing the log is gone: it is whole
            assert any("Started server process" in line for line in log.lines)  # the front ends' uvicorn logs come here
            assert not any(_ACCESS_LINE in line for line in log.lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_while_starting_stops_what_has_started(monkeypatch):
    """A SIGTERM while the model loads stops the processes started so far (its default would kill the launcher
    alone, leaving the front ends to wait minutes for a core that never listens) and exits 0."""
    from mmengine.entrypoints import server_processes

    stops = []

    def start(self):
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the handler raises in here
            time.sleep(0.01)
        raise AssertionError("SIGTERM did not interrupt the start")

    monkeypatch.setattr(ServerProcesses, "start", start)
    monkeypatch.setattr(ServerProcesses, "stop", lambda self, exit_code=0: stops.append(exit_code))
    before = signal.getsignal(signal.SIGTERM)
    spec = FrontEndSpec("unused", {}, ServerSettings("unused"))
    assert server_processes.run_server_processes(spec, 2, "127.0.0.1", 0) == 0
    assert stops == [0] and signal.getsignal(signal.SIGTERM) is before


class _IdleEngine:
    """What EngineCore reads of an engine that has no request: its serving loop, without a model."""

    config = types.SimpleNamespace(multimodal_config=types.SimpleNamespace(mm_processor_cache_bytes=0))

    def has_unfinished_requests(self) -> bool:
        return False

    def reset_prefix_cache(self) -> bool:
        return True


class _HeldClock:
    """core_process's time, with a monotonic clock that moves only when the test moves it: the front end's call
    lands in the orphaned core's window whatever the machine's load (a real 0.3 s window had to hold the test
    thread's wake-up, its poll and the call)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.mark.parametrize("front_end_leaves", [True, False])
def test_a_core_whose_launcher_is_gone_serves_its_front_ends_until_they_leave(monkeypatch, front_end_leaves):
    """The launcher killed: the core serves its front ends while they stop (their answers in flight finish) and
    leaves once they have left, or after ORPHANED_SERVE_SECONDS whatever they do; then its run directory goes
    (core_process_main). Before, it left at once, under front ends still writing their metrics files there."""
    from multiprocessing import Pipe

    from mmengine.engine import core_process

    monkeypatch.setattr(core_process, "ORPHANED_SERVE_SECONDS", 30.0 if front_end_leaves else 0.3)
    clock = _HeldClock()
    monkeypatch.setattr(core_process, "time", clock)
    launcher, launcher_at_core = Pipe()
    front_end, front_end_at_core = Pipe()
    core = core_process.EngineCore(_IdleEngine(), launcher_at_core, {})
    core.front_ends.append(front_end_at_core)
    serving = threading.Thread(target=core.serve)
    serving.start()
    try:
        launcher.close()  # killed
        assert wait_until(lambda: launcher_at_core not in core.front_ends, timeout_s=10)  # the core saw it go
        front_end.send((core_process.CALL, 1, "reset_prefix_cache", {}))
        assert front_end.poll(10) and front_end.recv() == (core_process.REPLY, 1, True, True)  # still served
        if front_end_leaves:
            front_end.close()
        else:
            clock.now += 0.3  # the window has passed: the core leaves though its front end stays
        serving.join(10)
        assert not serving.is_alive()
    finally:
        if serving.is_alive():
            front_end.close()
            serving.join(60)


def test_a_front_end_whose_launcher_goes_while_it_starts_leaves_at_once():
    """Killed while the model loads, the launcher leaves a core that may never listen: a front end still
    starting leaves at once (exit code 1) instead of trying to connect for minutes; once serving, the
    launcher's going is handled by stopping uvicorn (the tests above)."""
    from multiprocessing import Pipe

    from mmengine.entrypoints.server_processes import leave_if_launcher_goes_while_starting

    for serving, expected in ((False, [1]), (True, [])):
        launcher, ours = Pipe()
        flag, exits = threading.Event(), []
        if serving:
            flag.set()
        watcher = threading.Thread(target=leave_if_launcher_goes_while_starting, args=(ours, flag, exits.append))
        watcher.start()
        launcher.close()
        watcher.join(30)
        assert not watcher.is_alive() and exits == expected
        ours.close()


def test_the_launcher_imports_no_engine_module():
    """`mmengine serve --api-server-count N` up to the spawn imports neither torch nor transformers nor the
    server's own stack: the launcher only spawns and watches, and the processes it starts do not wait on it."""
    code = ("import sys\n"
            "from mmengine.entrypoints import serve_cli, server_processes\n"
            "heavy = ('torch', 'transformers', 'fastapi', 'uvicorn', 'mmengine.engine.mm_engine')\n"
            "server_processes.run_server_processes = lambda *_: print(sorted(m for m in heavy if m in sys.modules)) or 0\n"
            "serve_cli.run_serve(['--model', 'unused', '--api-server-count', '2', '--port', '0'])\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]"
