"""AsyncMMEngine without HTTP: delta streams that add up to generate()'s outputs, requests joining a
running loop, preprocessing on the worker pool and steps on the loop thread, cancellation freeing
blocks and encoder references, back-pressure, and failures that stay with the request that caused them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers import paced_on_first_reads, wait_until

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine, DeltaOutput, EngineDeadError, EngineOverloadedError, RequestFailedError
from mmengine.errors import ConfigError, ImageCountMismatchError
from mmengine.testing import make_test_image

IMAGE_PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
TEXT_PROMPT = "USER: Tell me a story. ASSISTANT:"


def run(coroutine, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


# Every test runs with synchronous steps and with async scheduling (a CUDA engine's default). In fp32
# (a GPU's default would be bf16): streamed requests are batched otherwise than generate()'s, and their
# greedy tokens are compared with its.
@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def engine(checkpoint_dir, request):
    return MMEngine(str(checkpoint_dir()), max_model_len=256, async_scheduling=request.param, dtype="float32")


@pytest.fixture(params=["off", "on"], ids=["sync", "async"])
def fresh_engine(checkpoint_dir, request):
    return MMEngine(str(checkpoint_dir()), max_model_len=256, async_scheduling=request.param, dtype="float32")


async def collect(stream) -> tuple[str, list[int], list[DeltaOutput]]:
    deltas = [delta async for delta in stream]
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas


async def wait_until_idle(engine: MMEngine, timeout: float = 10) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return engine.stats()


def test_delta_streams_add_up_to_generate(engine, monkeypatch):
    image = make_test_image(501)
    expected = engine.generate([IMAGE_PROMPT, TEXT_PROMPT], images=[[image], None], sampling_params=greedy(12),
                               use_tqdm=False)
    # A reader that falls behind gets the outputs so far as one delta (by design): on a fast GPU, or with the event
    # loop's thread off the CPU a while (a loaded machine: it failed so), a request's twelve steps can all be done
    # before its reader runs. So no step after a request's first output runs before its reader has read a delta.
    paced_step, first_read = paced_on_first_reads(engine.step)
    monkeypatch.setattr(engine, "step", paced_step)

    async def read(stream):
        deltas = []
        async for delta in stream:
            first_read.setdefault(stream.request_id, threading.Event()).set()
            deltas.append(delta)
        return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas

    async def main():
        async with AsyncMMEngine(engine) as async_engine:
            first = asyncio.ensure_future(read(await async_engine.add_request(IMAGE_PROMPT, [image], greedy(12))))
            second = asyncio.ensure_future(read(await async_engine.add_request(TEXT_PROMPT, None, greedy(12))))
            return await asyncio.gather(first, second)

    for (text, tokens, deltas), reference in zip(run(main()), expected):
        assert text == reference.text and tokens == reference.token_ids
        assert len(deltas) > 1 and all(not d.finished for d in deltas[:-1])
        last = deltas[-1]
        assert last.finish_reason == reference.finish_reason and last.num_output_tokens == len(reference.token_ids)
        assert last.num_prompt_tokens == len(reference.prompt_token_ids)


def test_requests_join_while_others_run(engine):
    async def main():
        async with AsyncMMEngine(engine) as async_engine:
            finished_order = []

            async def consume(name, stream):
                text, tokens, _ = await collect(stream)
                finished_order.append(name)
                return tokens

            long = await async_engine.add_request(TEXT_PROMPT, None, greedy(60, ignore_eos=True))
            deltas = aiter(long)
            first = [await anext(deltas) for _ in range(3)]  # the long one is running...
            short = await async_engine.add_request(IMAGE_PROMPT, [make_test_image(502)], greedy(4))  # ...when this joins
            rest, short_tokens = await asyncio.gather(consume("long", deltas), consume("short", short))
            return [t for d in first for t in d.token_ids] + rest, short_tokens, finished_order

    long_tokens, short_tokens, order = run(main())
    assert order == ["short", "long"]  # batched into the running loop, not queued behind it
    (reference,) = engine.generate(TEXT_PROMPT, sampling_params=greedy(60, ignore_eos=True), use_tqdm=False)
    assert long_tokens == reference.token_ids and len(short_tokens) == 4


def test_preprocessing_runs_on_the_pool_and_steps_on_the_loop_thread(engine, monkeypatch):
    threads = {"process": set(), "step": set()}
    process, step = engine.input_processor.process, engine.step

    def recording(kind, function):
        def wrapper(*args, **kwargs):
            threads[kind].add(threading.current_thread().name)
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(engine.input_processor, "process", recording("process", process))
    monkeypatch.setattr(engine, "step", recording("step", step))

    async def main():
        async with AsyncMMEngine(engine) as async_engine:
            streams = [await async_engine.add_request(IMAGE_PROMPT, [make_test_image(503 + i)], greedy(3)) for i in range(3)]
            await asyncio.gather(*(collect(stream) for stream in streams))
            return threading.current_thread().name

    event_loop_thread = run(main())
    assert threads["process"] and all(name.startswith("mmengine-preprocess") for name in threads["process"])
    assert threads["step"] == {"mmengine-step-loop"}
    assert event_loop_thread not in threads["process"] | threads["step"]


def test_a_cancelled_consumer_frees_its_blocks(engine):
    async def main():
        async with AsyncMMEngine(engine) as async_engine:
            stream = await async_engine.add_request(IMAGE_PROMPT, [make_test_image(510)], greedy(200, ignore_eos=True))
            got_two = asyncio.Event()

            async def consumer():
                count = 0
                async for _ in stream:
                    count += 1
                    if count == 2:
                        got_two.set()

            task = asyncio.create_task(consumer())
            await got_two.wait()
            during = engine.stats()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return during, await wait_until_idle(engine), async_engine.num_in_flight

    during, after, in_flight = run(main())
    assert during["kv_blocks_free"] < during["kv_blocks_total"]
    assert after["kv_blocks_free"] == after["kv_blocks_total"] and after["encoder_cache_referenced"] == 0
    assert after["requests_running"] == after["requests_waiting"] == 0 and in_flight == 0
    assert after["generation_tokens"] - during["generation_tokens"] < 20  # stopped, not run to 200 tokens


def test_an_abort_mid_prefill_frees_the_encoder_reference_before_the_next_step(checkpoint_dir, monkeypatch):
    # A small token budget prefills the prompt in chunks; the loop pauses after a step that leaves
    # the image's encoder output referenced (its placeholders are not all computed yet).
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, max_num_batched_tokens=8)
    paused, resume = threading.Event(), threading.Event()
    step = engine.step

    def step_then_pause():
        outputs = step()
        if engine.encoder_cache.num_referenced and not paused.is_set():
            paused.set()
            assert resume.wait(30)
        return outputs

    monkeypatch.setattr(engine, "step", step_then_pause)

    async def main():
        async with AsyncMMEngine(engine) as async_engine:
            stream = await async_engine.add_request(IMAGE_PROMPT, [make_test_image(511)], greedy(50))
            while not paused.is_set():
                await asyncio.sleep(0.005)
            during = engine.stats()
            stream.abort()
            steps_at_abort = during["steps"]
            resume.set()
            return during, steps_at_abort, await wait_until_idle(engine)

    during, steps_at_abort, after = run(main())
    assert during["encoder_cache_referenced"] == 1 and during["kv_blocks_free"] < during["kv_blocks_total"]
    assert after["encoder_cache_referenced"] == 0 and after["kv_blocks_free"] == after["kv_blocks_total"]
    assert after["steps"] == steps_at_abort and after["generation_tokens"] == 0  # no step ran for it after the abort


class _Gate:
    """Holds InputProcessor.process on its worker thread until released."""

    def __init__(self, engine: MMEngine, monkeypatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        process = engine.input_processor.process

        def gated(*args, **kwargs):
            self.entered.set()
            assert self.release.wait(30)
            return process(*args, **kwargs)

        monkeypatch.setattr(engine.input_processor, "process", gated)

    async def wait_entered(self) -> None:
        while not self.entered.is_set():
            await asyncio.sleep(0.005)


def test_a_request_cancelled_while_preprocessing_is_never_run(fresh_engine, monkeypatch):
    gate = _Gate(fresh_engine, monkeypatch)

    async def main():
        async with AsyncMMEngine(fresh_engine) as async_engine:
            adding = asyncio.create_task(async_engine.add_request(TEXT_PROMPT, None, greedy(50)))
            await gate.wait_entered()
            adding.cancel()
            with pytest.raises(asyncio.CancelledError):
                await adding  # returns at once: the worker is still inside process()
            gate.release.set()
            await asyncio.sleep(0.1)  # the worker finishes meanwhile, and must not queue it
            return await wait_until_idle(fresh_engine), async_engine.num_in_flight, async_engine.num_queued

    stats, in_flight, queued = run(main())
    assert stats["prompt_tokens"] == 0 and stats["generation_tokens"] == 0  # never queued in the engine
    assert in_flight == 0 and queued == 0


def test_past_max_queued_requests_new_requests_are_refused(fresh_engine, monkeypatch):
    gate = _Gate(fresh_engine, monkeypatch)

    async def main():
        async with AsyncMMEngine(fresh_engine, max_queued_requests=1) as async_engine:
            first = asyncio.create_task(async_engine.add_request(TEXT_PROMPT, None, greedy(3)))
            await gate.wait_entered()
            assert async_engine.num_queued == 1
            with pytest.raises(EngineOverloadedError, match="max_queued_requests=1") as refused:
                await async_engine.add_request(TEXT_PROMPT, None, greedy(3))
            gate.release.set()
            _, tokens, _ = await collect(await first)
            assert async_engine.num_queued == 0
            _, again, _ = await collect(await async_engine.add_request(TEXT_PROMPT, None, greedy(3)))
            return refused.value.retry_after, tokens, again

    retry_after, tokens, again = run(main())
    assert retry_after >= 1 and len(tokens) == 3 and again == tokens


class _Schedules:
    """The request ids of every step the scheduler makes, and how many steps were made when each request was
    queued (counts of steps, never times)."""

    def __init__(self, engine: MMEngine, monkeypatch) -> None:
        self.steps: list[set[str]] = []
        self.queued_after: dict[str, int] = {}
        schedule, enqueue = engine.scheduler.schedule, engine.steps.enqueue

        def recording_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if not out.is_empty:
                self.steps.append({s.request.request_id for s in out.scheduled if s.num_new_tokens})
            return out

        def recording_enqueue(*args, **kwargs):
            request_id = enqueue(*args, **kwargs)
            self.queued_after[request_id] = len(self.steps)
            return request_id

        monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
        monkeypatch.setattr(engine.steps, "enqueue", recording_enqueue)

    def first_step_of(self, request_id: str) -> int:
        return next(index for index, ids in enumerate(self.steps) if request_id in ids)


def test_a_request_being_prepared_joins_the_next_step(engine, monkeypatch):
    """Turnaround: while a request is prepared on the pool (here held there), the loop starts no step, so the
    request is in the step after the one that ran when it arrived, not several steps later (each over a slot
    fewer). A count of steps: the hold only gives a loop that does not wait the time to step on."""
    schedules = _Schedules(engine, monkeypatch)

    async def main():
        async with AsyncMMEngine(engine, max_admission_wait_s=60) as async_engine:
            long = await async_engine.add_request(TEXT_PROMPT, None, greedy(120, ignore_eos=True))
            deltas = aiter(long)
            for _ in range(2):  # the long one is running
                await anext(deltas)
            gate = _Gate(engine, monkeypatch)
            adding = asyncio.create_task(async_engine.add_request(IMAGE_PROMPT, [make_test_image(506)], greedy(2)))
            await gate.wait_entered()
            at_arrival = len(schedules.steps)
            await asyncio.to_thread(wait_until, lambda: len(schedules.steps) >= at_arrival + 3, 1.0)
            stepped_while_preparing = len(schedules.steps) - at_arrival
            gate.release.set()
            short = await adding
            short_tokens = (await collect(short))[1]
            long.abort()
            return short.request_id, short_tokens, stepped_while_preparing

    request_id, short_tokens, stepped_while_preparing = run(main())
    assert len(short_tokens) == 2
    assert stepped_while_preparing <= 1  # at most the step that was running when it arrived
    assert schedules.first_step_of(request_id) == schedules.queued_after[request_id]  # the very next step


def test_the_wait_for_a_request_being_prepared_is_bounded(fresh_engine, monkeypatch):
    """A preparation that takes long (a big video, a slow pool) holds the running requests back for at most
    max_admission_wait_s a step: they go on stepping meanwhile."""
    schedules = _Schedules(fresh_engine, monkeypatch)

    async def main():
        async with AsyncMMEngine(fresh_engine, max_admission_wait_s=0.01) as async_engine:
            long = await async_engine.add_request(TEXT_PROMPT, None, greedy(120, ignore_eos=True))
            deltas = aiter(long)
            await anext(deltas)
            gate = _Gate(fresh_engine, monkeypatch)
            adding = asyncio.create_task(async_engine.add_request(TEXT_PROMPT, None, greedy(2)))
            await gate.wait_entered()
            at_arrival = len(schedules.steps)
            stepped_on = await asyncio.to_thread(wait_until, lambda: len(schedules.steps) >= at_arrival + 3, 30)
            gate.release.set()
            tokens = (await collect(await adding))[1]
            long.abort()
            return stepped_on, tokens

    stepped_on, tokens = run(main())
    assert stepped_on and len(tokens) == 2


@pytest.mark.parametrize("value", [-0.1, float("inf"), "0.1", True])
def test_a_bad_max_admission_wait_is_a_config_error(engine, value):
    with pytest.raises(ConfigError, match="max_admission_wait_s"):
        AsyncMMEngine(engine, max_admission_wait_s=value)


def test_stop_strings_never_stream_text_they_later_cut(engine):
    (plain,) = engine.generate(TEXT_PROMPT, sampling_params=greedy(24, ignore_eos=True), use_tqdm=False)
    middle = len(plain.text) // 2
    stop = plain.text[middle : middle + 3]
    (expected,) = engine.generate(TEXT_PROMPT, sampling_params=greedy(24, ignore_eos=True, stop=[stop]), use_tqdm=False)

    async def main():
        async with AsyncMMEngine(engine) as async_engine:
            return await collect(await async_engine.add_request(TEXT_PROMPT, None, greedy(24, ignore_eos=True, stop=[stop])))

    text, _, deltas = run(main())
    assert text == expected.text and stop not in text
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


def test_fill_max_tokens_takes_the_room_the_prompt_leaves(fresh_engine):
    async def main():
        async with AsyncMMEngine(fresh_engine) as async_engine:
            stream = await async_engine.add_request(TEXT_PROMPT, None, greedy(1, ignore_eos=True), fill_max_tokens=True)
            return (await collect(stream))[2][-1], async_engine.max_output_tokens(0)

    last, room = run(main())
    assert room == 256  # max_model_len; the KV cache holds more
    assert last.finish_reason == "length" and last.num_output_tokens == 256 - last.num_prompt_tokens


def test_bad_input_raises_before_anything_is_queued(engine):
    async def main():
        async with AsyncMMEngine(engine) as async_engine:
            with pytest.raises(ImageCountMismatchError, match="1 <image> marker"):
                await async_engine.add_request(IMAGE_PROMPT, None, greedy(3))
            return async_engine.num_in_flight, async_engine.num_queued, engine.has_unfinished_requests()

    assert run(main()) == (0, 0, False)


def test_a_step_that_fails_once_is_retried(fresh_engine, monkeypatch):
    step = fresh_engine.step
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("transient failure")
        return step()

    (expected,) = fresh_engine.generate(TEXT_PROMPT, sampling_params=greedy(8), use_tqdm=False)
    monkeypatch.setattr(fresh_engine, "step", flaky)

    async def main():
        async with AsyncMMEngine(fresh_engine) as async_engine:
            return (await collect(await async_engine.add_request(TEXT_PROMPT, None, greedy(8))))[1]

    assert run(main()) == expected.token_ids and len(calls) > 3


def test_a_request_whose_steps_keep_failing_fails_alone(fresh_engine, monkeypatch):
    step = fresh_engine.step

    def poisoned():
        if "poison" in fresh_engine.scheduler.requests:
            raise RuntimeError("this request breaks every step")
        return step()

    (expected,) = fresh_engine.generate(TEXT_PROMPT, sampling_params=greedy(40, ignore_eos=True), use_tqdm=False)
    monkeypatch.setattr(fresh_engine, "step", poisoned)

    async def main():
        async with AsyncMMEngine(fresh_engine) as async_engine:
            good = await async_engine.add_request(TEXT_PROMPT, None, greedy(40, ignore_eos=True))
            deltas = aiter(good)
            first = await anext(deltas)
            bad = await async_engine.add_request(TEXT_PROMPT, None, greedy(5), request_id="poison")
            with pytest.raises(RequestFailedError, match="poison"):
                await collect(bad)
            _, rest, _ = await collect(deltas)
            after = await collect(await async_engine.add_request(TEXT_PROMPT, None, greedy(3)))
            return first.token_ids + rest, after[1], async_engine.is_healthy

    tokens, after, healthy = run(main())
    assert tokens == expected.token_ids and len(after) == 3 and healthy
    stats = fresh_engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_dead_loop_fails_every_stream_and_health(fresh_engine, monkeypatch):
    def broken():
        raise RuntimeError("the loop itself is broken")

    monkeypatch.setattr(fresh_engine, "has_unfinished_requests", broken)

    async def main():
        async_engine = AsyncMMEngine(fresh_engine)
        stream = await async_engine.add_request(TEXT_PROMPT, None, greedy(3))
        with pytest.raises(EngineDeadError, match="the loop itself is broken"):
            await collect(stream)
        healthy = async_engine.is_healthy
        with pytest.raises(EngineDeadError):
            await async_engine.add_request(TEXT_PROMPT, None, greedy(3))
        await async_engine.shutdown()
        return healthy

    assert run(main()) is False
