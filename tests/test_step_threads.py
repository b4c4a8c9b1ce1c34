"""A CPU engine with preprocessing workers steps on the torch threads its busy workers leave
(engine/step_threads.py), and generate() steps a batch's first prompts while a later picture is still in a
worker: here a pool whose worker is held back until the model has started every other prompt."""

from __future__ import annotations

import io
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from mmengine import MMEngine, SamplingParams
from mmengine.engine.step_threads import StepThreads
from mmengine.testing import make_test_image
from mmengine.testing.qwen_vl import qwen_vl_prompt

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
HOLD_S = 60.0  # a bound on the held picture's wait, generous for a loaded machine: reaching it means no overlap


@pytest.fixture
def threads():
    """The process's torch threads set to `threads(n)` for the test, and put back after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize(("own", "busy", "width"), [(3, 0, 3), (3, 1, 2), (3, 2, 1), (3, 5, 1), (1, 1, 1)])
def test_a_step_takes_the_threads_the_busy_workers_leave(threads, own, busy, width):
    threads(own)
    step_threads = StepThreads(types.SimpleNamespace(num_in_flight=busy))
    with step_threads.around_step() as given:
        assert given == width and torch.get_num_threads() == width
    assert torch.get_num_threads() == own  # the process's own setting is back
    assert step_threads.num_narrowed == (width < own)


def test_the_setting_is_back_after_a_failed_step(threads):
    threads(2)
    with pytest.raises(RuntimeError, match="boom"), StepThreads(types.SimpleNamespace(num_in_flight=1)).around_step():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


class HeldPool:
    """A preprocessing pool stand-in: prepares pictures with the engine's own preparer, on the caller's thread,
    counting those in flight as the pool does; the picture `held` waits (in flight) until `release` is set, and
    `prepared` is set once it has left the pool."""

    num_workers = 2

    def __init__(self, preparer, held: bytes) -> None:
        self.preparer, self.held = preparer, held
        self.release, self.prepared = threading.Event(), threading.Event()
        self.released_in_time: bool | None = None
        self.num_in_flight = 0
        self.holding = False  # the held picture is in flight (counted in num_in_flight)
        self._lock = threading.Lock()

    def prepare(self, encoded: bytes, index: int, path: str | None = None):
        with self._lock:
            self.num_in_flight += 1
            self.holding = self.holding or encoded == self.held
        try:
            if encoded == self.held:
                self.released_in_time = self.release.wait(HOLD_S)
            return self.preparer.prepare_encoded(encoded, index, path)
        finally:
            with self._lock:
                self.num_in_flight -= 1
                if encoded == self.held:
                    self.holding = False
            if encoded == self.held:
                self.prepared.set()


class RecordingStepThreads(StepThreads):
    """StepThreads that records, for each step, the held pool's state as the step began and the threads it got:
    "holding" (the held picture in its worker), "after" (it has left the pool, the last to do so) or "before"."""

    def __init__(self, pool: HeldPool) -> None:
        super().__init__(pool)
        self.seen: list[tuple[str, int]] = []

    @contextmanager
    def around_step(self) -> Iterator[int]:
        state = "holding" if self.pool.holding else "after" if self.pool.prepared.is_set() else "before"
        with super().around_step() as width:
            self.seen.append((state, torch.get_num_threads()))  # what the step's torch ops really get
            yield width


def release_once_the_others_started(engine: MMEngine, pool: HeldPool, num_prompts: int, monkeypatch,
                                    after_step: Callable[[set[str]], None] | None = None) -> set[str]:
    """Patches the engine so the scheduler's steps record the requests they start (the set returned), and each
    step, after `after_step(started)`, releases the held picture once every other prompt has started."""
    started: set[str] = set()
    advance, schedule = engine.steps.advance, engine.scheduler.schedule

    def schedule_and_count():
        out = schedule()
        started.update(s.request.request_id for s in out.scheduled if s.num_new_tokens > 0)
        return out

    def advance_and_release():
        advance()
        if after_step is not None:
            after_step(started)
        if len(started) == num_prompts - 1:
            pool.release.set()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_and_count)
    monkeypatch.setattr(engine.steps, "advance", advance_and_release)
    return started


def jpeg(seed: int) -> bytes:
    buffer = io.BytesIO()
    make_test_image(seed, size=(160, 120)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def test_generate_steps_every_other_prompt_while_a_worker_holds_the_last_picture(family_checkpoint, threads, monkeypatch):
    engine = MMEngine(str(family_checkpoint("qwen2_5_vl")), device="cpu", dtype="float32", max_model_len=512)
    prompts = [qwen_vl_prompt(f"Question {i}: what is here?", 1) for i in range(5)]
    images = [[jpeg(70 + i)] for i in range(5)]
    pool = HeldPool(engine.input_processor.pictures, held=images[-1][0])
    monkeypatch.setattr(engine.input_processor, "pool", pool)
    step_threads = RecordingStepThreads(pool)
    monkeypatch.setattr(engine, "step_threads", step_threads)
    threads(2)
    started = release_once_the_others_started(engine, pool, len(prompts), monkeypatch)
    got = engine.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert pool.released_in_time is True  # every other prompt started while the last picture was in its worker
    assert len(started) == len(prompts)
    widths = {state: {width for seen, width in step_threads.seen if seen == state} for state in ("holding", "after")}
    # one thread left to the worker holding the picture, then both once the pool is idle (steps before the held
    # picture reached the pool depend on what else was in flight then: not checked)
    assert widths == {"holding": {1}, "after": {2}}
    assert step_threads.num_narrowed == sum(width < 2 for _, width in step_threads.seen)
    assert torch.get_num_threads() == 2
    monkeypatch.undo()  # the same prompts on the engine's own threads: the same tokens
    want = engine.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert [out.token_ids for out in got] == [out.token_ids for out in want]


def test_generate_runs_the_prompts_whose_pictures_are_ready_while_the_first_is_held(family_checkpoint, monkeypatch):
    """The first prompt's picture is held in its worker until the model has started every other prompt: those are
    queued and stepped meanwhile (not held back behind it), and the outputs still come in input order, with the
    tokens of the same prompts prepared on the engine's own threads."""
    engine = MMEngine(str(family_checkpoint("qwen2_5_vl")), device="cpu", dtype="float32", max_model_len=512)
    prompts = [qwen_vl_prompt(f"Question {i}: what is in this picture?", 1) for i in range(5)]
    images = [[jpeg(80 + i)] for i in range(5)]
    pool = HeldPool(engine.input_processor.pictures, held=images[0][0])
    monkeypatch.setattr(engine.input_processor, "pool", pool)
    queued: list[str] = []  # request ids, in the order the engine queued them
    started_while_held: set[str] = set()
    enqueue = engine.steps.enqueue

    def enqueue_and_record(processed, *args, **kwargs):
        request_id = enqueue(processed, *args, **kwargs)
        queued.append(request_id)
        return request_id

    def note_if_held(started: set[str]) -> None:
        if not pool.prepared.is_set():
            started_while_held.update(started)

    monkeypatch.setattr(engine.steps, "enqueue", enqueue_and_record)
    release_once_the_others_started(engine, pool, len(prompts), monkeypatch, after_step=note_if_held)
    got = engine.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert pool.released_in_time is True  # every other prompt started while the first picture was in its worker
    assert started_while_held == {out.request_id for out in got[1:]}  # stepped before the first prompt was queued
    assert len(queued) == len(prompts) and queued[-1] == got[0].request_id  # the held prompt queued last
    monkeypatch.undo()  # the same prompts on the engine's own threads: the same prompts' tokens, in input order
    want = engine.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert [out.prompt_token_ids for out in got] == [out.prompt_token_ids for out in want]
    assert [out.token_ids for out in got] == [out.token_ids for out in want]
