"""Plain builders for unit tests of the scheduler and KV cache (no model needed), and a failure injector."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mmengine.core.request import MMItem, ProcessedPrompt, Request
from mmengine.sample.params import SamplingParams


# A one-image prompt and short greedy params, for tests that need any valid request.
IMAGE_PROMPT = "USER: <image>\nWhat is shown? ASSISTANT:"
SHORT_GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int = 4,
    images: list[tuple[int, int]] = (),
    arrival: int = 0,
    tokens: list[int] | None = None,
    image_hashes: list[str] | None = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    **params: object,
) -> Request:
    """A request whose prompt is `tokens` (default 1..n), with image items at (offset, length)."""
    hashes = image_hashes or [f"img{i}" for i in range(len(images))]
    items = [MMItem("image", h, off, length, {"pixel_values": torch.zeros(1)}) for h, (off, length) in zip(hashes, images)]
    processed = ProcessedPrompt(None, tokens if tokens is not None else list(range(1, num_prompt_tokens + 1)), items)
    return Request(
        request_id, processed, SamplingParams(max_tokens=max_tokens, **params), arrival,
        cache_salt=cache_salt, lora_name=lora_name,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    encoder_capacity: int = 1000,
    encoder_budget: int = 1000,
    enable_prefix_caching: bool = True,
    **config: object,
):
    """A scheduler wired to real KV and encoder cache managers, for tests without a model."""
    from mmengine.config import EngineConfig
    from mmengine.encoder_cache.manager import EncoderCacheManager
    from mmengine.kv_cache.block_hash import make_hash_function
    from mmengine.kv_cache.manager import KVCacheManager
    from mmengine.core.scheduler import Scheduler

    engine_config = EngineConfig(model="unused", block_size=block_size, enable_prefix_caching=enable_prefix_caching, **config)
    kv = KVCacheManager(num_blocks, block_size, make_hash_function("xxh3_128", 0), enable_prefix_caching=enable_prefix_caching)
    encoder = EncoderCacheManager(encoder_capacity, kv.uncache_pinning)
    kv.pin_listener = encoder
    return Scheduler(engine_config, kv, encoder, encoder_budget, max_model_len=1024)


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint's safetensors files, by name."""
    from safetensors import safe_open

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


class FailOnce:
    """Wraps a method so that its next call raises, as a CUDA OOM would; later calls go through."""

    def __init__(self, method):
        self.method, self.armed = method, True

    def __call__(self, *args, **kwargs):
        if self.armed:
            self.armed = False
            raise MemoryError("injected failure")
        return self.method(*args, **kwargs)


def load_benchmark(name: str) -> types.ModuleType:
    """benchmarks/<name>.py as a module (registered in sys.modules, where its dataclasses look it up)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def record_prefill_chunks(engine) -> list[tuple[int, int]]:
    """Spies on the engine's scheduler: the returned list fills with the (start, end) of every chunk of more
    than one token it schedules from here on (prefill chunks)."""
    chunks: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def spied():
        output = schedule()
        chunks.extend((s.start, s.end) for s in output.scheduled if s.end - s.start > 1)
        return output

    engine.scheduler.schedule = spied
    return chunks


def record_draft_proposals(engine) -> list[dict[str, list[int]]]:
    """Every proposal the engine's draft head makes from now on (request id -> drafts), in step order: only
    those made after the request's prefill (one whose last chunk is its last token drafts before that chunk)."""
    drafter, proposals = engine.steps.drafts.drafter, []
    propose = drafter.propose

    def recording(wanted):
        drafts = propose(wanted)
        proposals.append({rid: list(d) for rid, d in drafts.items() if engine.scheduler.requests[rid].num_output_tokens})
        return drafts

    drafter.propose = recording
    return proposals


def stop_recording_draft_proposals(engine) -> None:
    drafter = engine.steps.drafts.drafter
    drafter.propose = type(drafter).propose.__get__(drafter)


def wait_until(condition, timeout_s: float = 15.0) -> bool:
    """Polls `condition` until it holds or `timeout_s` passes (a bounded wait for an outcome); its last value."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(condition())


SHM = "/dev/shm"


def shared_memory_held(pids) -> dict[tuple[int, int], int]:
    """The shared-memory segments the processes hold a descriptor or a mapping on (in /dev/shm, named or unlinked,
    and memfds): {(device, inode): bytes}. These processes' own: /dev/shm's listing and used space change with every
    process on the machine (the other test worker's ranks and pools, Ray's object store)."""
    held: dict[tuple[int, int], int] = {}

    def hold(key: tuple[int, int], size: int) -> None:
        held[key] = max(held.get(key, 0), size)

    for pid in pids:
        with contextlib.suppress(OSError):  # a process gone meanwhile holds nothing
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):  # closed meanwhile
                    if _is_shared_memory(os.readlink(f"/proc/{pid}/fd/{fd}")):
                        stat = os.stat(f"/proc/{pid}/fd/{fd}")
                        hold((stat.st_dev, stat.st_ino), stat.st_size)
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:  # start-end perms offset major:minor inode path
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and _is_shared_memory(fields[5]):
                        start, end = (int(value, 16) for value in fields[0].split("-"))
                        major, minor = (int(value, 16) for value in fields[3].split(":"))
                        hold((os.makedev(major, minor), int(fields[4])), end - start)
    return held


def _is_shared_memory(path: str) -> bool:
    return path.startswith((SHM + "/", "/memfd:"))


def shm_files_made_by(pids) -> set[str]:
    """The files in /dev/shm that torch made for these processes (its segments' names carry the maker's pid); other
    processes' files come and go there meanwhile."""
    if not os.path.isdir(SHM):
        return set()
    prefixes = tuple(f"torch_{pid}_" for pid in pids)
    return {name for name in os.listdir(SHM) if name.startswith(prefixes)}


def _is_rays(process) -> bool:
    """One of Ray's processes: its own servers and agents, and its workers (titled ray::<what they run>)."""
    name = process.name()
    return name.startswith("ray::") or name in ("raylet", "gcs_server") or "/ray/" in " ".join(process.cmdline()[:3])


@dataclass
class LocalRay:
    """The tests' local Ray cluster (conftest's `ray_cluster`), and a shutdown that leaves no process of Ray's behind."""

    # A start waits seconds for Python processes' start-ups, none of which an option of ray.init skips (Ray 2.60):
    # include_dashboard=False still starts the dashboard head (its usage-stats module only) and waits for it to
    # publish its address; the raylet registers only once its dashboard agent and runtime-env agent are up (with
    # _system_config enable_metrics_collection=False too); the driver's connect waits for the workers Ray prestarts
    # for the first job (prestart_worker_first_driver=False only moves that wait to the first task or actor).
    OPTIONS = {"num_cpus": 4, "include_dashboard": False, "log_to_driver": False, "configure_logging": False}

    before: frozenset[int]  # this process's descendants before Ray started

    @classmethod
    def start(cls) -> LocalRay:
        import psutil
        import ray

        before = frozenset(child.pid for child in psutil.Process().children(recursive=True))
        # Ray Serve's own start-up freeze off in its workers (recent Ray Serve freezes each replica's heap after its
        # __init__; the ray extra allows older ones): the tests see mmengine's replicas freeze theirs
        previous = os.environ.get("RAY_SERVE_FREEZE_GC_ON_STARTUP")
        os.environ["RAY_SERVE_FREEZE_GC_ON_STARTUP"] = "0"  # read where Ray's processes start, inherited from here
        try:
            ray.init(**cls.OPTIONS)
        finally:
            if previous is None:
                del os.environ["RAY_SERVE_FREEZE_GC_ON_STARTUP"]
            else:
                os.environ["RAY_SERVE_FREEZE_GC_ON_STARTUP"] = previous
        return cls(before)

    def processes(self) -> list:
        import psutil

        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.pid not in self.before and child.status() != psutil.STATUS_ZOMBIE and _is_rays(child):
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
        return found

    def stop(self, timeout_s: float = 30.0) -> None:
        """ray.shutdown, then a bounded wait for Ray's workers, which leave on their own after their raylet; any
        still there are killed (by pid)."""
        import psutil
        import ray

        processes = self.processes()  # taken now: a worker whose raylet is gone is no longer this process's descendant
        ray.shutdown(wait_for_processes=True)

        def running(process) -> bool:
            try:
                return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        def left() -> list:
            return [process for process in processes + self.processes() if running(process)]

        if not wait_until(lambda: not left(), timeout_s):
            for process in left():
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            psutil.wait_procs(left(), timeout=10)


@contextlib.contextmanager
def tensor_parallel_pairs(paths: dict[str, Path], options_of: dict[str, dict] | None = None, **options):
    """name -> (checkpoint, TP 1 engine, TP 2 engine) for each checkpoint: the TP 2 engines start at once, in threads,
    while this process builds the TP 1 engines (a TP 2 start-up is two interpreters importing torch); stopped after.
    `options_of`: a name's own options besides `options`."""
    from concurrent.futures import ThreadPoolExecutor

    from mmengine import MMEngine

    with ThreadPoolExecutor(len(paths)) as pool:
        own = {name: {**options, **(options_of or {}).get(name, {})} for name in paths}
        futures = {name: pool.submit(MMEngine, str(path), tensor_parallel_size=2, **own[name]) for name, path in paths.items()}
        ones = {name: MMEngine(str(path), **own[name]) for name, path in paths.items()}
        pairs = {name: (paths[name], ones[name], futures[name].result()) for name in paths}
    try:
        yield pairs
    finally:
        for _, _, two in pairs.values():
            two.shutdown()


class RecordedSlices:
    """Records which rows of which checkpoint tensor are read (CheckpointSlices, wrapped)."""

    def __init__(self, monkeypatch) -> None:
        from mmengine.distributed import checkpoint_slices

        self.reads: dict[str, list[object]] = {}
        original = checkpoint_slices.CheckpointSlices.__iter__
        reads = self.reads

        class Recorded(checkpoint_slices.CheckpointSlice):
            def __init__(self, name: str, inner) -> None:
                super().__init__(inner.raw)
                self.name = name

            def __getitem__(self, index: object) -> torch.Tensor:
                reads.setdefault(self.name, []).append(index)
                return super().__getitem__(index)

        def recording(slices):
            for name, tensor in original(slices):
                yield name, Recorded(name, tensor)

        monkeypatch.setattr(checkpoint_slices.CheckpointSlices, "__iter__", recording)


def paced_on_first_reads(step: Callable[[], list]) -> tuple[Callable[[], list], dict[str, threading.Event]]:
    """`step` wrapped so that no step runs after a request's first output until its reader has said it read a delta
    (`first_read.setdefault(request_id, threading.Event()).set()` on the returned dict). A reader late for its
    first delta gets the outputs so far as one delta, by design, and a loaded machine can step a whole short answer
    meanwhile: tests that count deltas pace the engine so."""
    first_read: dict[str, threading.Event] = {}

    def paced_step() -> list:
        for read in list(first_read.values()):
            assert read.wait(30)
        outputs = step()
        for output in outputs:
            if output.token_ids:  # a delta for its reader
                first_read.setdefault(output.request_id, threading.Event())
        return outputs

    return paced_step, first_read


def alive(pid: int | None) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped by its parent, does not)."""
    import psutil

    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
