"""A bounded soak of `mmengine serve`: many clients for N minutes, on loopback only.

Clients send chat requests with pictures (a shared pool, plus fresh ones so the caches churn),
streaming and not; a share of them are bad requests (each kind must get a 4xx naming the problem)
and a share disconnect in the middle of a stream (the server must abort them). The run is bounded
in time (--minutes) and in requests (--max-requests), and every request has a timeout.

Reported: requests served by kind, answers by kind and HTTP status, anything unexpected (a 5xx, a
timeout, a 200 for a bad request), TTFT and latency percentiles, the server's RSS over the run and
whether it grows, and the engine's books when the load stops: KV blocks free, encoder references,
requests running, which must all return to their idle values.

    python benchmarks/soak.py --minutes 10                 # the tiny built-in model on CPU
    python benchmarks/soak.py --minutes 0.2 --clients 4    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import io
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from mmengine.testing import make_test_image

MODEL_NAME = "soak"
IMAGE_LIMIT = 2  # the server's limit_mm_per_prompt in this soak
# What each client does per request, with weights.
GOOD = {"stream": 4, "plain": 3, "disconnect": 1, "structured": 2}
# "structured": n=2 answers under a small JSON schema, with logprobs and a presence penalty
SCHEMA = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}}, "required": ["count", "ok"], "additionalProperties": False}
BAD = ("corrupt_image", "too_many_images", "unsupported_field", "too_long", "malformed_json", "no_messages", "bad_url")
BAD_SHARE = 0.15
QUESTIONS = ["What is shown?", "Describe the colours.", "Count the shapes.", "Give it a title.", "What stands out?"]


def _sibling(name: str):
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Tally:
    served: Counter = field(default_factory=Counter)  # kind -> completed as intended
    answers: Counter = field(default_factory=Counter)  # "kind status" -> count
    unexpected: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    sent: int = 0


def png_url(seed: int, size: tuple[int, int]) -> str:
    buffer = io.BytesIO()
    make_test_image(seed, size=size).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class Workload:
    """Draws requests: pictures from a shared pool (and sometimes a fresh one), and bad ones by kind."""

    def __init__(self, rng: random.Random, image_size: tuple[int, int], pool_size: int, fresh_share: float) -> None:
        self.rng, self.image_size, self.fresh_share = rng, image_size, fresh_share
        self.pool = [png_url(7000 + i, image_size) for i in range(pool_size)]
        self.next_fresh = 100_000

    def picture(self) -> str:
        if self.rng.random() < self.fresh_share:
            self.next_fresh += 1
            return png_url(self.next_fresh, self.image_size)
        return self.rng.choice(self.pool)

    def good(self, max_tokens: int) -> dict:
        content = [{"type": "image_url", "image_url": {"url": self.picture()}} for _ in range(self.rng.randint(0, IMAGE_LIMIT))]
        content.append({"type": "text", "text": self.rng.choice(QUESTIONS)})
        return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": 0}

    def bad(self, kind: str, max_tokens: int) -> dict | str:
        body = self.good(max_tokens)
        content = body["messages"][0]["content"]
        if kind == "corrupt_image":
            content.insert(0, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"\x89PNG garbage").decode()}})
        elif kind == "too_many_images":
            content[:0] = [{"type": "image_url", "image_url": {"url": self.rng.choice(self.pool)}}] * (IMAGE_LIMIT + 1)
        elif kind == "unsupported_field":
            body["reasoning_effort"] = "high"  # a field this server does not implement: a 400 naming it
        elif kind == "too_long":
            body["max_tokens"] = 10**7
        elif kind == "malformed_json":
            return json.dumps(body)[:-7]
        elif kind == "no_messages":
            body["messages"] = []
        elif kind == "bad_url":
            content.insert(0, {"type": "image_url", "image_url": {"url": "ftp://127.0.0.1/picture.png"}})
        return body


async def one_request(client: httpx.AsyncClient, kind: str, body: dict | str, tally: Tally, timeout_s: float) -> None:
    tally.sent += 1
    start = time.perf_counter()
    try:
        if kind in BAD:
            content = body if isinstance(body, str) else json.dumps(body)
            response = await client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"},
                                         timeout=timeout_s)
            tally.answers[f"{kind} {response.status_code}"] += 1
            error = response.json().get("error", {}) if response.headers.get("content-type", "").startswith("application/json") else {}
            if 400 <= response.status_code < 500 and error.get("message"):
                tally.served[kind] += 1
            else:
                tally.unexpected.append(f"{kind}: HTTP {response.status_code} {response.text[:200]!r}")
            return
        if kind in ("plain", "structured"):
            response = await client.post("/v1/chat/completions", json=body, timeout=timeout_s)
            tally.answers[f"{kind} {response.status_code}"] += 1
            if response.status_code == 200 and _answered(kind, response.json()):
                tally.served[kind] += 1
                tally.latency_s.append(time.perf_counter() - start)
            else:
                tally.unexpected.append(f"{kind}: HTTP {response.status_code} {response.text[:200]!r}")
            return
        await _stream(client, kind, {**body, "stream": True}, tally, start, timeout_s)
    except (httpx.TransportError, asyncio.TimeoutError) as exc:
        tally.answers[f"{kind} {type(exc).__name__}"] += 1
        tally.unexpected.append(f"{kind}: {type(exc).__name__}: {exc}")


def _answered(kind: str, answer: dict) -> bool:
    """A plain answer has content; a structured one has two choices, each with logprobs, and each one
    that stopped is JSON of its schema."""
    choices = answer["choices"]
    if kind == "plain":
        return choices[0]["message"]["content"] is not None
    if len(choices) != 2 or any(not c["logprobs"] or not c["logprobs"]["content"] for c in choices):
        return False
    for choice in choices:
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            if set(value) != {"count", "ok"} or not 0 <= value["count"] <= 9 or not isinstance(value["ok"], bool):
                return False
    return True


async def _stream(client: httpx.AsyncClient, kind: str, body: dict, tally: Tally, start: float, timeout_s: float) -> None:
    await asyncio.wait_for(_read_stream(client, kind, body, tally, start), timeout_s)


async def _read_stream(client: httpx.AsyncClient, kind: str, body: dict, tally: Tally, start: float) -> None:
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        tally.answers[f"{kind} {response.status_code}"] += 1
        if response.status_code != 200:
            tally.unexpected.append(f"{kind}: HTTP {response.status_code} {(await response.aread())[:200]!r}")
            return
        first = None
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if "role" in delta:
                continue
            if first is None:
                first = time.perf_counter()
                tally.ttft_s.append(first - start)
                if kind == "disconnect":  # leave mid-stream: the connection closes with the block
                    tally.served[kind] += 1
                    return
        tally.served[kind] += 1
        tally.latency_s.append(time.perf_counter() - start)


async def run_clients(base: str, args: argparse.Namespace, tally: Tally, deadline: float) -> None:
    rng = random.Random(args.seed)
    workload = Workload(rng, args.image_size, args.pool_size, args.fresh_share)
    kinds, weights = list(GOOD), list(GOOD.values())

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline and tally.sent < args.max_requests:
            if rng.random() < BAD_SHARE:
                kind = rng.choice(BAD)
                body = workload.bad(kind, args.max_tokens)
            else:
                kind = rng.choices(kinds, weights)[0]
                body = workload.good(rng.randint(1, args.max_tokens))
                if kind == "structured":
                    body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA}},
                             "n": 2, "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.5, "max_tokens": 32}
            await one_request(client, kind, body, tally, args.request_timeout)

    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=args.request_timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))


# -- the server process and what it holds -------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process (Linux /proc; None elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def books(scrape, base: str) -> dict[str, float]:
    metrics = scrape(base)
    names = ("kv_blocks_free", "kv_blocks_total", "encoder_cache_referenced", "requests_running", "requests_waiting",
             "requests_in_flight", "client_disconnects_total")
    return {name: metrics.get(f"mmengine_{name}") for name in names}


def wait_idle(scrape, base: str, idle: dict[str, float], timeout_s: float = 60) -> dict[str, float]:
    """The books once the server has finished what is in flight (or as they stand at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = books(scrape, base)
        if all(now[k] == idle[k] for k in ("kv_blocks_free", "encoder_cache_referenced", "requests_running",
                                           "requests_waiting", "requests_in_flight")) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def memory_trend(samples: list[tuple[float, int]]) -> dict:
    """RSS over the run: first and last, and the growth from the middle of the run to its end (the
    first part is warm-up: caches filling to their bounds), with a least-squares slope over the second half."""
    if len(samples) < 4:
        return {"samples": len(samples)}
    times = np.array([t for t, _ in samples])
    rss = np.array([r for _, r in samples], dtype=np.float64) / 2**20
    half = len(samples) // 2
    slope = float(np.polyfit(times[half:] / 60, rss[half:], 1)[0]) if len(samples) - half >= 2 else 0.0
    middle = float(rss[half: half + max(1, len(samples) // 5)].mean())
    end = float(rss[-max(1, len(samples) // 5):].mean())
    return {"samples": len(samples), "start_mib": float(rss[0]), "max_mib": float(rss.max()), "end_mib": float(rss[-1]),
            "middle_mean_mib": middle, "end_mean_mib": end, "second_half_slope_mib_per_min": slope,
            "grows": bool(end - middle > max(16.0, 0.02 * middle))}


def start_server(model: str, port: int, engine_args: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "mmengine", "serve", "--model", model, "--port", str(port), "--host", "127.0.0.1",
               "--served-model-name", MODEL_NAME, "--log-level", "warning", "--limit-mm-per-prompt", f"image={IMAGE_LIMIT}",
               *engine_args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    array = np.array(values) * 1e3
    return {f"p{q}": float(np.percentile(array, q)) for q in (50, 90, 99)} | {"max": float(array.max())}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny LLaVA)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many requests in all")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--pool-size", type=int, default=12, help="pictures shared by the clients")
    parser.add_argument("--fresh-share", type=float, default=0.2, help="share of pictures that are new")
    parser.add_argument("--image-size", type=lambda s: tuple(int(v) for v in s.split("x")), default=(64, 48))
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--rss-interval", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-args", default="--mm-processor-cache-bytes 8388608 --max-model-len 512",
                        help="more `mmengine serve` flags (bounded caches, so growth past them is a leak)")
    parser.add_argument("--output", default="benchmarks/results/soak.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    serve = _sibling("serve")
    model = args.model
    if model is None:
        from mmengine.testing import tiny_llava_path

        model = str(tiny_llava_path())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    process = start_server(model, port, args.engine_args.split())
    try:
        serve._wait_healthy(base, process)
        httpx.post(base + "/v1/chat/completions", json=Workload(random.Random(0), args.image_size, 1, 0).good(2), timeout=120)
        idle = books(serve.scrape, base)
        tally, samples = Tally(), []
        t0 = time.monotonic()
        deadline = t0 + 60 * args.minutes

        async def run() -> None:
            async def sample_rss() -> None:
                while time.monotonic() < deadline and tally.sent < args.max_requests:
                    rss = rss_bytes(process.pid)
                    if rss is not None:
                        samples.append((time.monotonic() - t0, rss))
                    await asyncio.sleep(args.rss_interval)

            await asyncio.gather(run_clients(base, args, tally, deadline), sample_rss())

        asyncio.run(run())
        elapsed = time.monotonic() - t0
        after = wait_idle(serve.scrape, base, idle)
        final_rss = rss_bytes(process.pid)
        alive = process.poll() is None
    finally:
        serve.stop_process(process)
    back_to_idle = {k: after[k] == idle[k] for k in ("kv_blocks_free", "encoder_cache_referenced", "requests_running",
                                                     "requests_waiting", "requests_in_flight")}
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": model,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "model")},
        "elapsed_s": elapsed,
        "requests_sent": tally.sent,
        "requests_per_s": tally.sent / elapsed,
        "served_by_kind": dict(tally.served),
        "answers_by_kind_and_status": dict(sorted(tally.answers.items())),
        "unexpected": len(tally.unexpected),
        "unexpected_examples": tally.unexpected[:10],
        "ttft_ms_stream": percentiles(tally.ttft_s),
        "latency_ms": percentiles(tally.latency_s),
        "rss": memory_trend(samples) | {"after_idle_mib": None if final_rss is None else final_rss / 2**20},
        "idle_books_before": idle,
        "books_after": after,
        "back_to_idle": back_to_idle,
        "server_alive": alive,
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "settings", "idle_books_before")}, indent=1))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
