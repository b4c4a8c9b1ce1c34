"""Online serving: a multi-turn image-chat workload against `mmengine serve`, next to transformers.

N users each chat T turns about one of K shared pictures (user u talks about picture u % K; the
picture is sent in the first turn and stays in the history). Users arrive at --request-rate per
second (Poisson; inf: all at once) and send each turn as soon as the previous answer is complete,
streaming it. Reported: TTFT and inter-token latency percentiles, requests/s and output tokens/s,
and from the server's /metrics how often the vision encoder ran and the prefix cache hit.

The baseline is transformers' generate() answering the same conversations one request at a time
(TTFT and inter-token gaps timed with a streamer), as a plain script would serve them.

--structured runs the workload a second time on the same server with every turn constrained by a JSON
schema (response_format json_schema, the schemas of mmengine.testing.schemas in turn) and reports the
per-token overhead of constrained decoding: the mean inter-token gap against the unconstrained run's.

--online-offline runs, instead of the chat workload, --num-requests single-turn one-image chat requests (request i
asks about picture i % --num-pictures: by default 128 requests about 4 shared pictures), greedy, --output-len
tokens each (ignore_eos): online through the server with --concurrency clients (each sends its next request as soon
as its answer is complete; not streamed unless --stream), and offline through MMEngine.chat() in this process (the
same messages, rendered by the same chat template) twice: all at once (the server's max_num_seqs), and at the
clients' concurrency (max_num_seqs = --concurrency, the most the clients can ever have in flight). It prints the
three rates, online / offline against each, the CPU each side spent per request (online with --api-server-count > 1
split between the engine core and the front ends, so a run shows which of them bounds the server) and the engine steps
per request (32 clients never fill a step as generate() does), and checks that every answer is the same every way.

--api-server-count N starts the server with N front-end processes over one engine-core process; with
--online-offline it may be a list (1,4): the online side runs once per count, against one offline run.

--server-cpus and --client-cpus pin the server's processes (and the offline engine) and this process's clients to
separate CPUs (Linux). Unpinned on a small machine, the 32 clients' own CPU competes with the server's, which no
real deployment pays (its clients are elsewhere) and which makes online / offline swing from run to run.

    python benchmarks/serve.py                                   # tiny built-in model on CPU
    python benchmarks/serve.py --online-offline --api-server-count 2
    python benchmarks/serve.py --build-7b /tmp/llava-1.5-7b --device cuda --num-users 64 --turns 4 \\
        --request-rate 4 --output-len 128 --skip-baseline        # the LLaVA-1.5-7B shape on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib.util
import io
import json
import math
import os
import platform
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from mmengine.config import SchedulerConfig
from mmengine.testing import LLAVA_1_5_7B_SPEC, make_test_image, tiny_llava_path

MODEL_NAME = "bench"
QUESTIONS = ["What is shown in this picture?", "Describe the colours.", "Is there a pattern?", "What stands out?",
             "Count the shapes.", "Give it a title."]


@dataclass
class Conversation:
    user: int
    picture: int
    start_s: float  # arrival offset from the start of the run


@dataclass
class TurnResult:
    user: int
    turn: int
    ttft_s: float
    itl_s: list[float]
    latency_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class RunResult:
    elapsed_s: float
    turns: list[TurnResult] = field(default_factory=list)


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    output_tokens: int


@dataclass
class ThroughputRun:
    """The --online-offline requests run one way: the answers in request order. `cpu_s`: the CPU seconds the
    serving side spent meanwhile (the server's processes online, this process offline; None where unknown),
    `client_cpu_s` online the clients' (this process's)."""

    elapsed_s: float
    answers: list[Answer]
    engine_steps: int
    cpu_s: float | None = None
    client_cpu_s: float | None = None
    cpu_s_by_role: dict[str, float] | None = None  # online: Served.cpu_seconds_by_role's split of cpu_s

    def summary(self) -> dict[str, Any]:
        output_tokens = sum(a.output_tokens for a in self.answers)
        per_request = None if self.cpu_s is None else self.cpu_s / len(self.answers) * 1e3
        by_role = None if self.cpu_s_by_role is None else {
            role: seconds / len(self.answers) * 1e3 for role, seconds in self.cpu_s_by_role.items()}
        return {"requests": len(self.answers), "elapsed_s": self.elapsed_s, "requests_per_s": len(self.answers) / self.elapsed_s,
                "output_tokens_per_s": output_tokens / self.elapsed_s, "engine_steps": self.engine_steps,
                "engine_steps_per_request": self.engine_steps / len(self.answers),
                "cpu_s": self.cpu_s, "cpu_ms_per_request": per_request, "cpu_ms_per_request_by_role": by_role,
                "client_cpu_s": self.client_cpu_s}


def workload(num_users: int, num_pictures: int, request_rate: float, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    start, conversations = 0.0, []
    for user in range(num_users):
        conversations.append(Conversation(user, user % num_pictures, start))
        if math.isfinite(request_rate):
            start += rng.expovariate(request_rate)
    return conversations


def picture_urls(num_pictures: int, size: tuple[int, int]) -> list[str]:
    urls = []
    for index in range(num_pictures):
        buffer = io.BytesIO()
        make_test_image(1000 + index, size=size).save(buffer, "JPEG", quality=90)
        urls.append("data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode())
    return urls


def user_turn(turn: int, user: int, picture_url: str | None) -> dict:
    text = f"{QUESTIONS[turn % len(QUESTIONS)]} (user {user})"
    if picture_url is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture_url}}, {"type": "text", "text": text}]}


# -- mmengine: the server and its clients ------------------------------------------------------


@dataclass
class Served:
    """A running server: its URL, and its launcher's pid (None: uvicorn in a thread of this process)."""

    url: str
    pid: int | None = None

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of the server's processes so far (the launcher and every child)."""
        by_role = self.cpu_seconds_by_role()
        return None if by_role is None else sum(by_role.values())

    def cpu_seconds_by_role(self) -> dict[str, float] | None:
        """cpu_seconds() split by process: {"server": ...} for a one-process server (with its preprocessing
        workers), else {"launcher" (with multiprocessing's resource tracker), "engine core", "front ends" (each with
        its workers)}. The engine core is the child that listens on the unix socket its front ends connect to
        (server_processes.py's core.sock)."""
        if self.pid is None:
            return None
        import psutil

        def seconds(process: psutil.Process) -> float:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = process.cpu_times()
                return times.user + times.system
            return 0.0

        launcher = psutil.Process(self.pid)
        children = launcher.children()
        core = next((child for child in children if _listens_as_core(child)), None)
        if core is None:
            return {"server": sum(seconds(p) for p in [launcher, *launcher.children(recursive=True)])}
        trackers = [child for child in children if _is_resource_tracker(child)]  # the launcher's spawn machinery
        front_ends = [child for child in children if child.pid != core.pid and child not in trackers]
        return {"launcher": sum(seconds(p) for p in [launcher, *trackers]),
                "engine core": sum(seconds(p) for p in [core, *core.children(recursive=True)]),
                "front ends": sum(seconds(p) for child in front_ends for p in [child, *child.children(recursive=True)])}


def _is_resource_tracker(process: Any) -> bool:
    import psutil

    with contextlib.suppress(psutil.Error):
        return any("multiprocessing.resource_tracker" in part for part in process.cmdline())
    return False


def _listens_as_core(process: Any) -> bool:
    import psutil

    with contextlib.suppress(psutil.Error):
        return any(isinstance(c.laddr, str) and c.laddr.endswith("/core.sock") for c in process.net_connections(kind="unix"))
    return False


@contextlib.contextmanager
def mmengine_server(model: str, how: str, engine_args: list[str], api_server_count: int = 1,
                    torch_threads: int | None = None, pinning: CpuPinning | None = None) -> Iterator[Served]:
    """A running `mmengine serve` (a subprocess, or uvicorn in a thread of this process). With `pinning`, the
    server's processes run on its server CPUs (they inherit the launcher's affinity) and this process on its
    client CPUs until the server stops."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    if how == "thread":
        for url in _thread_server(model, port, engine_args):
            yield Served(url)
        return
    env = os.environ | ({"OMP_NUM_THREADS": str(torch_threads)} if torch_threads else {})
    with pinning.server_side() if pinning is not None else contextlib.nullcontext():
        process = subprocess.Popen(serve_command(model, port, engine_args, api_server_count), env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with pinning.client_side() if pinning is not None else contextlib.nullcontext():
            _wait_healthy(base, process)
            yield Served(base, process.pid)
    finally:
        stop_process(process)


@dataclass(frozen=True)
class CpuPinning:
    """Which CPUs the server (and the offline engine, for a like-for-like comparison) and the clients run on."""

    server: frozenset[int]
    client: frozenset[int]

    @contextlib.contextmanager
    def _pinned(self, cpus: frozenset[int]) -> Iterator[None]:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)

    def server_side(self) -> contextlib.AbstractContextManager[None]:
        return self._pinned(self.server)

    def client_side(self) -> contextlib.AbstractContextManager[None]:
        return self._pinned(self.client)


def _cpu_list(text: str) -> frozenset[int]:
    """'0', '0,2' or '0-3' -> the CPU numbers."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list (e.g. 0 or 0,2 or 0-3): {text!r}") from None
    if not cpus:
        raise argparse.ArgumentTypeError("empty CPU list")
    return frozenset(cpus)


def _count_list(text: str) -> list[int]:
    """'4' or '1,4' -> the counts, each >= 1."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count or a list of counts (e.g. 2 or 1,4): {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts must be >= 1: {text!r}")
    return counts


def cpu_pinning(args: argparse.Namespace) -> CpuPinning | None:
    """--server-cpus and --client-cpus, checked: both or neither, disjoint, on this machine, a server subprocess."""
    if args.server_cpus is None and args.client_cpus is None:
        return None
    if args.server_cpus is None or args.client_cpus is None:
        raise SystemExit("--server-cpus and --client-cpus go together")
    if args.server_cpus & args.client_cpus:
        raise SystemExit(f"--server-cpus and --client-cpus overlap: {sorted(args.server_cpus & args.client_cpus)}")
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("--server-cpus/--client-cpus need os.sched_setaffinity (Linux)")
    available = os.sched_getaffinity(0)
    if not (args.server_cpus | args.client_cpus) <= available:
        raise SystemExit(f"--server-cpus/--client-cpus: CPUs {sorted((args.server_cpus | args.client_cpus) - available)} "
                         f"are not available here ({sorted(available)})")
    if args.server == "thread":
        raise SystemExit("--server-cpus/--client-cpus need --server subprocess (a thread shares this process's CPUs)")
    return CpuPinning(args.server_cpus, args.client_cpus)


def serve_command(model: str, port: int, engine_args: list[str], api_server_count: int) -> list[str]:
    return [sys.executable, "-m", "mmengine", "serve", "--model", model, "--port", str(port),
            "--served-model-name", MODEL_NAME, "--log-level", "warning", "--api-server-count", str(api_server_count),
            *engine_args]


def stop_process(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def _thread_server(model: str, port: int, engine_args: list[str]) -> Iterator[str]:
    import uvicorn

    from mmengine.engine.async_engine import AsyncMMEngine
    from mmengine.entrypoints.api_server import ServerSettings, build_app
    from mmengine.entrypoints.serve_cli import build_serve_parser, engine_options

    args = build_serve_parser().parse_args(["--model", model, *engine_args])
    app = build_app(AsyncMMEngine.from_model(model, max_admission_wait_s=args.max_admission_wait_ms / 1000, **engine_options(args)),
                    ServerSettings(MODEL_NAME))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", None)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _wait_healthy(base: str, process: subprocess.Popen | None, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"mmengine serve exited: {process.stderr.read()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError("mmengine serve did not become healthy")


def scrape(base: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(base + "/metrics", timeout=60).text.splitlines():
        match = re.match(r"^(mmengine_\w+) (\S+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


async def _one_turn(client: httpx.AsyncClient, messages: list[dict], output_len: int,
                    response_format: dict | None = None) -> tuple[str, dict]:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if response_format is not None:
        body["response_format"] = response_format
    start = time.perf_counter()
    token_times, text, usage = [], [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else None
            if delta is not None and "role" not in delta:  # a chunk per step that gave this request tokens
                token_times.append(time.perf_counter())
                text.append(delta.get("content", ""))
    end = time.perf_counter()
    timing = {"ttft_s": (token_times[0] if token_times else end) - start,
              "itl_s": list(np.diff(token_times)) if len(token_times) > 1 else [], "latency_s": end - start}
    return "".join(text), {**timing, "usage": usage}


def schema_format(user: int, turn: int) -> dict:
    """The response_format of a --structured turn: the schemas of mmengine.testing.schemas in turn."""
    from mmengine.testing.schemas import SCHEMAS

    name = sorted(SCHEMAS)[(user + turn) % len(SCHEMAS)]
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


async def run_clients(base: str, conversations: list[Conversation], urls: list[str], turns: int, output_len: int,
                      structured: bool = False) -> RunResult:
    result = RunResult(0.0)

    async def user(client: httpx.AsyncClient, conversation: Conversation, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + conversation.start_s - time.perf_counter()))
        messages: list[dict] = []
        for turn in range(turns):
            messages.append(user_turn(turn, conversation.user, urls[conversation.picture] if turn == 0 else None))
            fmt = schema_format(conversation.user, turn) if structured else None
            answer, stats = await _one_turn(client, messages, output_len, fmt)
            messages.append({"role": "assistant", "content": answer})
            usage = stats["usage"]
            result.turns.append(TurnResult(conversation.user, turn, stats["ttft_s"], [float(x) for x in stats["itl_s"]],
                                           stats["latency_s"], usage["completion_tokens"], usage["prompt_tokens"],
                                           usage["prompt_tokens_details"]["cached_tokens"]))

    limits = httpx.Limits(max_connections=len(conversations) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as client:
        await _one_turn(client, [user_turn(0, -1, None)], 2)  # warm-up (not timed)
        t0 = time.perf_counter()
        await asyncio.gather(*(user(client, c, t0) for c in conversations))
        result.elapsed_s = time.perf_counter() - t0
    return result


# -- online / offline: the same requests through the server and through MMEngine.chat() -------


def single_turn_requests(num_requests: int, urls: list[str]) -> list[list[dict]]:
    """Request i: one user turn asking about picture i % len(urls)."""
    return [[user_turn(0, index, urls[index % len(urls)])] for index in range(num_requests)]


def greedy_body(messages: list[dict], output_len: int, stream: bool) -> dict:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return body | ({"stream_options": {"include_usage": True}} if stream else {})


async def _one_answer(client: httpx.AsyncClient, messages: list[dict], output_len: int, stream: bool) -> Answer:
    if stream:
        text, stats = await _one_turn(client, messages, output_len)
        usage = stats["usage"]
        return Answer(text, usage["prompt_tokens"], usage["completion_tokens"])
    response = await client.post("/v1/chat/completions", json=greedy_body(messages, output_len, stream=False))
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
    answer = response.json()
    usage = answer["usage"]
    return Answer(answer["choices"][0]["message"]["content"], usage["prompt_tokens"], usage["completion_tokens"])


async def run_online(server: Served, requests: list[list[dict]], output_len: int, concurrency: int,
                     stream: bool) -> ThroughputRun:
    """`concurrency` clients, each sending its next request as soon as its answer is complete. Each has an
    httpx client of its own: one pool of many connections costs the client more CPU per request than the
    server spends (httpcore scans every connection for every request), on the cores the server shares."""
    base = server.url
    answers: list[Answer | None] = [None] * len(requests)
    pending = iter(range(len(requests)))  # shared by the clients: each takes the next request

    async def client_loop(client: httpx.AsyncClient) -> None:
        for index in pending:
            answers[index] = await _one_answer(client, requests[index], output_len, stream)

    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=None)) for _ in range(concurrency)]
        await asyncio.gather(*(_one_answer(c, [user_turn(0, -1, None)], 2, stream) for c in clients))  # warm-up, not timed
        steps_before = scrape(base)["mmengine_steps_total"]
        cpu_before, client_cpu_before = server.cpu_seconds_by_role(), time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for client in clients))
        elapsed = time.perf_counter() - start
        cpu_after, client_cpu = server.cpu_seconds_by_role(), time.process_time() - client_cpu_before
    by_role = None if cpu_before is None else {role: cpu_after[role] - cpu_before[role] for role in cpu_after}
    return ThroughputRun(elapsed, answers, round(scrape(base)["mmengine_steps_total"] - steps_before),
                         None if by_role is None else sum(by_role.values()),
                         client_cpu if server.pid is not None else None, by_role)


def server_options(model: str, engine_args: list[str]) -> dict:
    """The engine options the server gets from `engine_args`."""
    from mmengine.entrypoints.serve_cli import build_serve_parser, engine_options

    return engine_options(build_serve_parser().parse_args(["--model", model, *engine_args]))


def run_offline(model: str, engine_args: list[str], requests: list[list[dict]], output_len: int,
                max_num_seqs: int | None = None) -> ThroughputRun:
    """The requests as one MMEngine.chat() batch in this process, on an engine with the server's options
    (`max_num_seqs`: with that many requests in flight at most, instead of the server's)."""
    from mmengine import MMEngine, SamplingParams

    options = server_options(model, engine_args) | ({"max_num_seqs": max_num_seqs} if max_num_seqs else {})
    with MMEngine(model, **options) as engine:
        warm_up = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        engine.chat([user_turn(0, -1, None)], sampling_params=warm_up, use_tqdm=False)  # as the online warm-up
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        steps_before = engine.stats()["steps"]
        cpu_before = time.process_time()
        start = time.perf_counter()
        outputs = engine.chat(requests, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_before
        steps = engine.stats()["steps"] - steps_before
    return ThroughputRun(elapsed, [Answer(o.text, len(o.prompt_token_ids), len(o.token_ids)) for o in outputs], steps, cpu)


def compare_answers(online: ThroughputRun, offline: ThroughputRun, allow_text_mismatch: bool) -> int:
    """How many answers are the same text both ways. Prompt and output token counts must always match
    (the same template and ignore_eos); texts too, unless allowed to differ."""
    counts = [[(a.prompt_tokens, a.output_tokens) for a in run.answers] for run in (online, offline)]
    if counts[0] != counts[1]:
        first = next(i for i, (a, b) in enumerate(zip(*counts)) if a != b)
        raise RuntimeError(f"online and offline token counts differ, first at request {first}: "
                           f"{online.answers[first]} vs {offline.answers[first]}")
    identical = sum(a.text == b.text for a, b in zip(online.answers, offline.answers))
    if identical < len(online.answers) and not allow_text_mismatch:
        first = next(i for i, (a, b) in enumerate(zip(online.answers, offline.answers)) if a.text != b.text)
        raise RuntimeError(f"greedy answers differ online and offline in {len(online.answers) - identical} of "
                           f"{len(online.answers)} requests, first at request {first}: {online.answers[first].text!r} vs "
                           f"{offline.answers[first].text!r}")
    return identical


def online_offline(args: argparse.Namespace, model: str, engine_args: list[str]) -> dict:
    """Online once per --api-server-count, then offline all at once and at the clients' concurrency (each
    server process is gone, and its memory freed, before the next starts and before an engine starts here).

    Two ratios, because they answer two questions. Against generate() with every request at once: what a
    user loses by serving instead of batching offline (the clients can never have more than --concurrency
    requests in flight, so this one also counts the smaller batches). Against generate() at the clients'
    concurrency (max_num_seqs = --concurrency): what the server itself costs, HTTP, the front end's work and
    the gaps while a client's next request travels, with the batch size held equal."""
    requests = single_turn_requests(args.num_requests, picture_urls(args.num_pictures, args.image_size))
    pinning = cpu_pinning(args)
    online: list[tuple[int, ThroughputRun]] = []
    for count in args.api_server_count:
        with mmengine_server(model, args.server, engine_args, count, args.torch_threads, pinning) as server:
            online.append((count, asyncio.run(run_online(server, requests, args.output_len, args.concurrency, args.stream))))
    server_seqs = server_options(model, engine_args).get("max_num_seqs", SchedulerConfig.max_num_seqs)
    at_concurrency = min(args.concurrency, server_seqs)
    with pinning.server_side() if pinning is not None else contextlib.nullcontext():
        offline = run_offline(model, engine_args, requests, args.output_len)
        offline_at_concurrency = run_offline(model, engine_args, requests, args.output_len, max_num_seqs=at_concurrency)
    compare_answers(offline_at_concurrency, offline, args.allow_text_mismatch)
    row = {"offline_all_at_once": offline.summary(),
           "offline_at_concurrency": offline_at_concurrency.summary() | {"max_num_seqs": at_concurrency},
           "online": [], "concurrency": args.concurrency, "stream": args.stream,
           "server_cpus": None if pinning is None else sorted(pinning.server),
           "client_cpus": None if pinning is None else sorted(pinning.client)}
    _print_side(f"offline, generate() all at once (max_num_seqs {server_seqs})", row["offline_all_at_once"])
    _print_side(f"offline, generate() at the clients' concurrency (max_num_seqs {at_concurrency})", row["offline_at_concurrency"])
    for count, run in online:
        side = run.summary() | {"api_server_count": count,
                                "identical_texts": compare_answers(run, offline, args.allow_text_mismatch)}
        side["ratio_vs_all_at_once"] = side["requests_per_s"] / row["offline_all_at_once"]["requests_per_s"]
        side["ratio_vs_at_concurrency"] = side["requests_per_s"] / row["offline_at_concurrency"]["requests_per_s"]
        row["online"].append(side)
        _print_side(f"online, {args.concurrency} clients, api-server-count {count}", side)
        print(f"online / offline all at once: {side['ratio_vs_all_at_once']:.2f}x; online / offline at concurrency "
              f"{at_concurrency}: {side['ratio_vs_at_concurrency']:.2f}x (api-server-count {count}); "
              f"{side['identical_texts']} of {args.num_requests} answers identical")
    return row


def _print_side(label: str, side: dict) -> None:
    cpu = "" if side["cpu_s"] is None else f", {side['cpu_ms_per_request']:.1f} CPU ms/request"
    by_role = side.get("cpu_ms_per_request_by_role")
    if by_role and len(by_role) > 1:
        cpu += " (" + ", ".join(f"{role} {ms:.1f}" for role, ms in by_role.items()) + ")"
    client = "" if side.get("client_cpu_s") is None else f"; the clients {side['client_cpu_s'] / side['requests'] * 1e3:.1f}"
    print(f"{label}: {side['requests']} requests in {side['elapsed_s']:.2f}s = {side['requests_per_s']:.2f} req/s, "
          f"{side['output_tokens_per_s']:.1f} output tok/s, {side['engine_steps']} engine steps "
          f"({side['engine_steps_per_request']:.2f} a request){cpu}{client}")


# -- transformers: the same conversations, one request at a time -------------------------------


def run_transformers(model: str, conversations: list[Conversation], turns: int, output_len: int, num_pictures: int,
                     image_size: tuple[int, int], device: str, dtype: torch.dtype) -> RunResult:
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:  # the first call carries the prompt, then one call per new token
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    hf = LlavaForConditionalGeneration.from_pretrained(model, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(model)
    pictures = []
    for index in range(num_pictures):  # the pictures the server gets, after the same JPEG round trip
        buffer = io.BytesIO()
        make_test_image(1000 + index, size=image_size).save(buffer, "JPEG", quality=90)
        pictures.append(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))
    result = RunResult(0.0)
    start_all = time.perf_counter()
    with torch.inference_mode():
        for conversation in sorted(conversations, key=lambda c: c.start_s):
            messages: list[dict] = []
            for turn in range(turns):
                text = user_turn(turn, conversation.user, None)["content"]
                content = [{"type": "image"}, {"type": "text", "text": text}] if turn == 0 else text
                messages.append({"role": "user", "content": content})
                prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
                clock = Clock()
                start = time.perf_counter()
                inputs = processor(text=prompt, images=[pictures[conversation.picture]], return_tensors="pt").to(device)
                inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
                out = hf.generate(**inputs, do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                                  streamer=clock)
                end = time.perf_counter()
                new = out[0, inputs["input_ids"].shape[1]:]
                messages.append({"role": "assistant", "content": processor.decode(new, skip_special_tokens=True)})
                token_times = clock.times[1:]
                result.turns.append(TurnResult(conversation.user, turn, token_times[0] - start,
                                               [float(x) for x in np.diff(token_times)], end - start, len(new),
                                               inputs["input_ids"].shape[1], 0))
    result.elapsed_s = time.perf_counter() - start_all
    return result


# -- report --------------------------------------------------------------------------------------


def summarize(run: RunResult) -> dict:
    ttft = np.array([t.ttft_s for t in run.turns]) * 1e3
    itl = np.array([gap for t in run.turns for gap in t.itl_s]) * 1e3
    latency = np.array([t.latency_s for t in run.turns]) * 1e3
    output_tokens = sum(t.output_tokens for t in run.turns)
    prompt_tokens = sum(t.prompt_tokens for t in run.turns)

    def percentiles(values: np.ndarray) -> dict[str, float]:
        if values.size == 0:
            return {}
        return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)} | {"mean": float(values.mean())}

    return {
        "requests": len(run.turns),
        "elapsed_s": run.elapsed_s,
        "requests_per_s": len(run.turns) / run.elapsed_s,
        "output_tokens_per_s": output_tokens / run.elapsed_s,
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "latency_ms": percentiles(latency),
        "cached_prompt_token_share": sum(t.cached_tokens for t in run.turns) / max(1, prompt_tokens),
    }


def _size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    return int(width), int(height)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny model)")
    source.add_argument("--build-7b", metavar="DIR", default=None,
                        help="build (if missing) and use a random-weight LLaVA-1.5-7B-shaped bf16 checkpoint in DIR (GPU)")
    parser.add_argument("--num-users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--num-pictures", type=int, default=4, help="pictures shared among the users")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="user arrivals per second (default: inf)")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--image-size", type=_size, default="640x480", help="WIDTHxHEIGHT of the pictures")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--server", choices=["subprocess", "thread"], default="subprocess",
                        help="run `mmengine serve` as a subprocess (default) or in a thread of this process")
    parser.add_argument("--api-server-count", type=_count_list, default=[1], metavar="N[,N...]",
                        help="front-end processes of the server (`mmengine serve --api-server-count`; subprocess only); "
                        "with --online-offline a list (e.g. 1,4): the online side once per count, the offline side once")
    parser.add_argument("--max-admission-wait-ms", type=float, default=0.0, metavar="MS",
                        help="the server's --max-admission-wait-ms (default: 0, steps never wait for requests being prepared)")
    parser.add_argument("--mm-processor-workers", type=int, default=0, metavar="N",
                        help="preprocessing worker processes of the engine (the server's, and offline the engine's here)")
    parser.add_argument("--torch-threads", type=int, default=None, metavar="N",
                        help="torch's intra-op threads, in this process and the server's (OMP_NUM_THREADS); default: "
                        "torch's own. On a CPU shared with other work, 1 keeps a step from waiting on a descheduled thread")
    parser.add_argument("--server-cpus", type=_cpu_list, default=None, metavar="LIST",
                        help="pin the server's processes, and the offline engine, to these CPUs (e.g. 0 or 0-3); with --client-cpus")
    parser.add_argument("--client-cpus", type=_cpu_list, default=None, metavar="LIST",
                        help="pin this process's clients to these CPUs, apart from the server's; with --server-cpus")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--structured", action="store_true",
                        help="also run every turn under a JSON schema and report the per-token overhead")
    comparison = parser.add_argument_group("--online-offline")
    comparison.add_argument("--online-offline", action="store_true",
                            help="instead of the chat workload: the same requests through the server and MMEngine.chat()")
    comparison.add_argument("--num-requests", type=int, default=128)
    comparison.add_argument("--concurrency", type=int, default=32, help="clients sending the requests online")
    comparison.add_argument("--stream", action="store_true", help="stream the answers online (default: whole answers)")
    comparison.add_argument("--allow-text-mismatch", action="store_true",
                            help="report, not fail on, greedy answers that differ (bf16 rounds differently by batch shape)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/serve.json")
    return parser.parse_args(argv)


def _ensure_7b(path: Path) -> Path:
    spec = importlib.util.spec_from_file_location("latency_benchmark", Path(__file__).with_name("latency.py"))
    latency = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(latency)
    return latency.ensure_checkpoint(path, LLAVA_1_5_7B_SPEC, "cuda", "bfloat16")[0]


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    for name in ("num_users", "turns", "num_pictures", "output_len", "num_requests", "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if len(args.api_server_count) > 1 and not args.online_offline:
        raise SystemExit("a list of --api-server-count values needs --online-offline (the chat workload runs one server)")
    if max(args.api_server_count) > 1 and args.server == "thread":
        raise SystemExit("--api-server-count > 1 needs --server subprocess")
    if cpu_pinning(args) is not None and args.torch_threads is None:
        args.torch_threads = len(args.server_cpus)  # one intra-op thread per pinned CPU, in the server and offline
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise SystemExit("--torch-threads must be >= 1")
        torch.set_num_threads(args.torch_threads)
    model = str(_ensure_7b(Path(args.build_7b)) if args.build_7b else (args.model or tiny_llava_path()))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = {"auto": torch.float32 if device == "cpu" else torch.bfloat16, "float32": torch.float32,
             "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    engine_args = ["--device", device, "--dtype", str(dtype).removeprefix("torch."), "--max-model-len", str(args.max_model_len),
                   "--mm-processor-workers", str(args.mm_processor_workers),
                   "--max-admission-wait-ms", str(args.max_admission_wait_ms)]
    result = {"model": model, "device": device, "dtype": str(dtype).removeprefix("torch."),
              "workload": {k: sorted(v) if isinstance(v, frozenset) else v  # (--server-cpus, --client-cpus)
                           for k, v in vars(args).items() if k not in ("output", "model", "build_7b")} | {
                  "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}}
    if args.online_offline:
        result["online_offline"] = online_offline(args, model, engine_args)
    else:
        result |= chat_workload(args, model, device, dtype, engine_args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")
    return result


def chat_workload(args: argparse.Namespace, model: str, device: str, dtype: torch.dtype, engine_args: list[str]) -> dict:
    """The multi-turn chat workload on the server (and --structured, and the transformers baseline)."""
    conversations = workload(args.num_users, args.num_pictures, args.request_rate, args.seed)
    urls = picture_urls(args.num_pictures, args.image_size)
    with mmengine_server(model, args.server, engine_args, args.api_server_count[0], args.torch_threads,
                         cpu_pinning(args)) as server:
        base = server.url
        before = scrape(base)
        run = asyncio.run(run_clients(base, conversations, urls, args.turns, args.output_len))
        after = scrape(base)
        structured = asyncio.run(run_clients(base, conversations, urls, args.turns, args.output_len, structured=True)) \
            if args.structured else None
    delta = {name: after[name] - before.get(name, 0.0) for name in after if name.endswith("_total")}
    ours = summarize(run) | {
        "encoder_runs": delta["mmengine_encoder_runs_total"],
        "images_sent": len(conversations) * args.turns,  # the picture stays in every turn's history
        "unique_pictures": len({c.picture for c in conversations}),
        "encoder_cache_hits": delta["mmengine_encoder_cache_hits_total"],
        "prefix_cache_hit_rate": delta["mmengine_prefix_cache_hits_total"] / max(1.0, delta["mmengine_prefix_cache_queries_total"]),
    }
    result = {"mmengine": ours}
    _print("mmengine serve", ours)
    print(f"  vision encoder: {ours['encoder_runs']:.0f} runs for {ours['images_sent']} images sent "
          f"({ours['unique_pictures']} unique), prefix cache hit rate {ours['prefix_cache_hit_rate']:.1%}")
    if structured is not None:
        constrained = summarize(structured)
        overhead = constrained["itl_ms"]["mean"] / ours["itl_ms"]["mean"] - 1
        result["structured"] = constrained | {"itl_overhead": overhead}
        _print("mmengine serve, every turn under a JSON schema", constrained)
        print(f"  constrained decoding costs {overhead:+.1%} per token (mean inter-token gap)")
    if not args.skip_baseline:
        base_run = run_transformers(model, conversations, args.turns, args.output_len, args.num_pictures,
                                    args.image_size, device, dtype)
        baseline = summarize(base_run) | {"encoder_runs": len(base_run.turns)}
        result["transformers_sequential"] = baseline
        result["speedup_requests_per_s"] = ours["requests_per_s"] / baseline["requests_per_s"]
        _print("transformers, one request at a time", baseline)
        print(f"  mmengine serves {result['speedup_requests_per_s']:.1f}x the requests/s")
    return result


def _print(name: str, row: dict) -> None:
    ttft, itl = row["ttft_ms"], row["itl_ms"]
    print(f"{name}: {row['requests']} requests in {row['elapsed_s']:.2f}s = {row['requests_per_s']:.2f} req/s, "
          f"{row['output_tokens_per_s']:.1f} output tok/s")
    print(f"  TTFT ms p50/p90/p99 {ttft['p50']:.1f}/{ttft['p90']:.1f}/{ttft['p99']:.1f}; "
          f"inter-token ms p50/p90/p99 {itl.get('p50', 0):.1f}/{itl.get('p90', 0):.1f}/{itl.get('p99', 0):.1f}")


if __name__ == "__main__":
    main()
