"""AsyncMMEngine with its engine core in a process of its own (engine_core="process", engine/core_client.py and
engine/core_process.py): the greedy tokens and stream deltas of the thread core, one encoder cache for every
request, a stream left early aborted in the core, bad pictures failing in the front end with their typed
errors, a killed core turning into EngineDeadError for requests in flight and new ones within seconds, and no
process left behind."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import threading
import time

import pytest
from helpers import alive, wait_until

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine, DeltaOutput
from mmengine.engine.core_client import EngineCoreClient
from mmengine.errors import ConfigError, CorruptImageError, EngineDeadError, ImageCountMismatchError
from mmengine.testing import make_test_image
from mmengine.testing.qwen_vl import qwen_vl_prompt

LLAVA_PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
LLAVA_TWO = "USER: <image>\n<image>\nCompare them. ASSISTANT:"
TEXT_PROMPT = "USER: Tell me a story. ASSISTANT:"
OPTIONS = {"max_model_len": 256, "dtype": "float32", "device": "cpu"}


def run(coroutine, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def jpeg(seed: int) -> bytes:
    buffer = io.BytesIO()
    make_test_image(seed, size=(96, 80)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


async def collect(stream) -> tuple[str, list[int], list[DeltaOutput]]:
    deltas = [delta async for delta in stream]
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas


@pytest.fixture(scope="module")
def llava(checkpoint_dir):
    return str(checkpoint_dir())


@pytest.fixture(scope="module")
def thread_engine(llava):
    return MMEngine(llava, **OPTIONS)


@pytest.fixture(scope="module")
def core(llava):
    """One engine-core process for the module; each test drives it through an AsyncMMEngine of its own (an
    AsyncMMEngine serves one event loop). The last test that uses it kills it."""
    client = EngineCoreClient(llava, engine_core="process", **OPTIONS)
    pid = client.core_pid
    assert alive(pid)
    yield client
    client.close()
    assert not alive(pid)  # stopped and reaped


async def run_batch(engine, requests) -> list[tuple[str, list[int], list[DeltaOutput]]]:
    async with AsyncMMEngine(engine) as async_engine:
        streams = [await async_engine.add_request(prompt, images, params) for prompt, images, params in requests]
        return await asyncio.gather(*(collect(stream) for stream in streams))


def test_the_process_core_gives_the_thread_cores_tokens_and_deltas(core, thread_engine):
    red, blue = jpeg(1), make_test_image(2)
    requests = [(LLAVA_PROMPT, [red], greedy(10)), (LLAVA_TWO, [blue, red], greedy(8)), (TEXT_PROMPT, None, greedy(6)),
                (LLAVA_PROMPT, [blue], greedy(12, stop=["e"]))]
    got = run(run_batch(core, requests))
    want = run(run_batch(thread_engine, requests))
    for (text, tokens, deltas), (want_text, want_tokens, want_deltas) in zip(got, want):
        assert (text, tokens) == (want_text, want_tokens)
        assert all(not d.finished for d in deltas[:-1]) and deltas[-1].finished
        for field in ("finish_reason", "stop_reason", "num_prompt_tokens", "num_output_tokens", "prompt_token_ids"):
            assert getattr(deltas[-1], field) == getattr(want_deltas[-1], field), field


def test_a_picture_shared_by_two_requests_is_encoded_once_in_the_core(core):
    picture = jpeg(11)
    before = core.stats()
    run(run_batch(core, [(LLAVA_PROMPT, [picture], greedy(3)), (LLAVA_TWO, [picture, picture], greedy(3))]))
    after = core.stats()
    assert after["encoder_runs"] - before["encoder_runs"] == 1
    assert after["images_decoded"] - before["images_decoded"] == 1  # the front end's intake decoded it once


def test_a_picture_crosses_to_the_core_once(core, thread_engine):
    """A picture the core holds from this front end crosses without its tensors: the thread core's tokens."""
    picture, other = jpeg(51), jpeg(52)
    requests = [(LLAVA_PROMPT, [picture], greedy(4)), (LLAVA_TWO, [other, picture], greedy(4)),
                (LLAVA_PROMPT, [picture], greedy(4))]
    before = core.num_items_sent_bare
    got = run(run_batch(core, requests))
    assert core.num_items_sent_bare - before == 2  # the picture's second and third time
    assert [tokens for _, tokens, _ in got] == [tokens for _, tokens, _ in run(run_batch(thread_engine, requests))]


def test_a_whole_answer_crosses_from_the_core_twice(core, thread_engine, monkeypatch):
    """The core sends a whole (non-streamed) answer's output at its first token and at its end only, stepped as
    generate() steps its own from the first token on: the tokens and text of a streamed request and of generate()."""
    handed_back: dict[str, int] = {}
    step = core.step

    def counted_step():
        outputs = step()
        for output in outputs:
            handed_back[output.request_id] = handed_back.get(output.request_id, 0) + 1
        return outputs

    monkeypatch.setattr(core, "step", counted_step)
    params, picture = greedy(9, ignore_eos=True), jpeg(41)

    async def main():
        async with AsyncMMEngine(core) as async_engine:
            whole = await async_engine.add_request(LLAVA_PROMPT, [picture], params, request_id="whole", whole_answer=True)
            streamed = await async_engine.add_request(LLAVA_PROMPT, [picture], params, request_id="streamed")
            answers = await asyncio.gather(collect(whole), collect(streamed))
            left = await async_engine.add_request(LLAVA_PROMPT, [picture], params, request_id="left", whole_answer=True)
            async for _ in left:
                break  # after its first token: aborted in the core
            settled = await asyncio.to_thread(wait_until, lambda: not core.has_unfinished_requests(), 10)
            return answers, core.stats(), settled

    (whole, streamed), stats, settled = run(main())
    (expected,) = thread_engine.generate(LLAVA_PROMPT, images=[picture], sampling_params=params, use_tqdm=False)
    assert whole[:2] == streamed[:2] == (expected.text, expected.token_ids)
    # two outputs crossed (handed_back, below); a consumer that fell behind the loop reads them as one delta
    assert len(whole[2]) in (1, 2) and whole[2][0].token_ids and whole[2][-1].finish_reason == "length"
    assert handed_back["whole"] == 2 and handed_back["streamed"] == 9
    assert handed_back["left"] <= 2  # its first token, and the abort's final output if it came before the stream ended
    assert settled  # the front end's books let the left request go (the core sent its final output)
    assert stats["requests_running"] == stats["requests_waiting"] == 0 and stats["encoder_cache_referenced"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_request_being_prepared_joins_the_cores_next_step(core, monkeypatch):
    """The front end tells the core when it starts preparing a request, and the core's next step waits for it (here
    held in preparation, with a long max wait): the core runs at most the step it was running meanwhile. A count of
    the core's steps; the hold only gives a core that does not wait the time to step on."""
    entered, release = threading.Event(), threading.Event()
    process = core.input_processor.process

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return process(*args, **kwargs)

    async def main():
        async with AsyncMMEngine(core, max_admission_wait_s=60) as async_engine:
            long = await async_engine.add_request(TEXT_PROMPT, None, greedy(150, ignore_eos=True))
            deltas = aiter(long)
            for _ in range(2):  # the long one is running in the core
                await anext(deltas)
            monkeypatch.setattr(core.input_processor, "process", held)
            adding = asyncio.create_task(async_engine.add_request(TEXT_PROMPT, None, greedy(2)))
            await asyncio.to_thread(entered.wait, 30)
            at_arrival = core.stats()["steps"]
            await asyncio.to_thread(wait_until, lambda: core.stats()["steps"] >= at_arrival + 3, 1.0)
            stepped_while_preparing = core.stats()["steps"] - at_arrival
            release.set()
            _, tokens, _ = await collect(await adding)
            long.abort()
            settled = await asyncio.to_thread(wait_until, lambda: not core.has_unfinished_requests(), 10)
            return stepped_while_preparing, tokens, settled

    stepped_while_preparing, tokens, settled = run(main())
    assert stepped_while_preparing <= 1 and len(tokens) == 2 and settled


def test_a_request_that_fails_in_preparation_is_not_waited_for(core):
    """A request announced to the core that then fails in the front end (a corrupt picture) is withdrawn: the core
    steps on at once instead of waiting the long max wait for it."""

    async def main():
        async with AsyncMMEngine(core, max_admission_wait_s=60) as async_engine:
            long = await async_engine.add_request(TEXT_PROMPT, None, greedy(150, ignore_eos=True))
            deltas = aiter(long)
            await anext(deltas)
            with pytest.raises(CorruptImageError):
                await async_engine.add_request(LLAVA_PROMPT, [b"not a picture"], greedy(2))
            at_failure = core.stats()["steps"]
            stepped_on = await asyncio.to_thread(wait_until, lambda: core.stats()["steps"] >= at_failure + 3, 20)
            long.abort()
            settled = await asyncio.to_thread(wait_until, lambda: not core.has_unfinished_requests(), 10)
            return stepped_on, settled

    assert run(main()) == (True, True)


def test_leaving_a_stream_aborts_its_request_in_the_core(core):
    before = core.stats()

    async def main():
        async with AsyncMMEngine(core) as async_engine:
            stream = await async_engine.add_request(LLAVA_PROMPT, [jpeg(21)], greedy(200, ignore_eos=True))
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            settled = await asyncio.to_thread(wait_until, lambda: not core.has_unfinished_requests(), 10)
            return core.stats(), settled

    after, settled = run(main())
    assert settled  # the core sent the aborted request's final output: the front end's books let it go
    assert after["requests_running"] == after["requests_waiting"] == 0
    assert after["encoder_cache_referenced"] == 0 and after["kv_blocks_free"] == after["kv_blocks_total"]
    assert 2 <= after["generation_tokens"] - before["generation_tokens"] < 200


def test_bad_pictures_fail_in_the_front_end_with_their_typed_errors(core, thread_engine):
    async def ask(engine, images, prompt=LLAVA_PROMPT):
        async with AsyncMMEngine(engine) as async_engine:
            with pytest.raises((CorruptImageError, ImageCountMismatchError)) as err:
                await async_engine.add_request(prompt, images, greedy(2))
            return type(err.value), str(err.value)

    before = core.stats()
    for images, prompt in (([jpeg(31)[:200]], LLAVA_PROMPT), ([jpeg(32)], LLAVA_TWO)):
        got, want = run(ask(core, images, prompt)), run(ask(thread_engine, images, prompt))
        assert got == want
    assert run(ask(core, [jpeg(33)[:100]]))[1].startswith("prompt 0: image 0: ")
    assert core.stats()["prompt_tokens"] == before["prompt_tokens"]  # nothing reached the core


def test_a_core_its_front_end_spawned_leaves_without_the_interpreters_teardown(monkeypatch):
    """The core EngineCoreClient spawns runs owned_core_main: core_main, then os._exit(0) (the interpreter's teardown
    with torch and the model loaded took seconds of CPU, and the front end's close waited for it)."""
    from mmengine.engine import core_process

    calls = []
    monkeypatch.setattr(core_process, "core_main", lambda *args: calls.append(("core_main", args)))
    monkeypatch.setattr(core_process.os, "_exit", lambda code: calls.append(("exit", code)))
    core_process.owned_core_main("model", {}, None)
    assert calls == [("core_main", ("model", {}, None)), ("exit", 0)]


def test_a_killed_core_fails_every_request_fast_and_leaves_no_process(core):
    """The last test of the module's core (it kills it; the tests after this one start cores of their own)."""

    async def main():
        async_engine = AsyncMMEngine(core)
        pid = core.core_pid
        streams = [await async_engine.add_request(LLAVA_PROMPT, [jpeg(40 + i)], greedy(200, ignore_eos=True))
                   for i in range(2)]
        iterators = [aiter(stream) for stream in streams]
        for iterator in iterators:
            await anext(iterator)  # both running in the core
        assert async_engine.is_healthy
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for iterator in iterators:
            with pytest.raises(EngineDeadError, match=r"engine-core process died \(exit code -9\)"):
                async for _ in iterator:
                    pass
        in_flight_failed = time.monotonic() - killed
        with pytest.raises(EngineDeadError):
            await async_engine.add_request(LLAVA_PROMPT, [jpeg(49)], greedy(2))
        healthy = async_engine.is_healthy
        await async_engine.shutdown()
        core.close()  # reaps it (the module's teardown closes it again: a no-op)
        return pid, in_flight_failed, time.monotonic() - killed, healthy

    pid, in_flight_failed, new_failed, healthy = run(main(), timeout=180)
    assert in_flight_failed < 10 and new_failed < 10
    assert not healthy and not alive(pid)


def test_mm_engine_refuses_a_process_core(llava):
    with pytest.raises(ConfigError, match="engine_core='process' is AsyncMMEngine's"):
        MMEngine(llava, engine_core="process", **OPTIONS)


@pytest.fixture(scope="module")
def qwen(family_checkpoint):
    return str(family_checkpoint("qwen2_5_vl"))


@pytest.fixture(scope="module")
def qwen_core(qwen):
    """A Qwen2.5-VL engine-core process, its front end (this process) with a preprocessing worker. The server
    test, its last, kills it."""
    client = EngineCoreClient(qwen, engine_core="process", mm_processor_workers=1, **OPTIONS)
    pid = client.core_pid
    yield client
    client.close()
    assert not alive(pid)


def test_qwen_through_the_process_core_with_preprocessing_workers(qwen, qwen_core):
    """Qwen2.5-VL's M-RoPE positions and native-resolution pixels cross too; with preprocessing workers the
    front end's pool prepares the pictures (their tensors already in shared memory)."""
    prompts = [qwen_vl_prompt(f"Question {i}: what is here?", 1) for i in range(3)]
    pictures = [jpeg(50), jpeg(51), jpeg(50)]
    reference = MMEngine(qwen, **OPTIONS).generate(prompts, images=[[p] for p in pictures], sampling_params=greedy(6),
                                                   use_tqdm=False)

    async def main():
        async_engine = AsyncMMEngine(qwen_core)
        try:
            streams = [await async_engine.add_request(prompt, [picture], greedy(6)) for prompt, picture in zip(prompts, pictures)]
            results = await asyncio.gather(*(collect(stream) for stream in streams))
            return results, qwen_core.stats()
        finally:
            await async_engine.shutdown()

    before = qwen_core.stats()
    prepared = qwen_core.input_processor.pool.num_prepared
    results, stats = run(main(), timeout=240)
    assert [tokens for _, tokens, _ in results] == [out.token_ids for out in reference]
    assert stats["encoder_runs"] - before["encoder_runs"] == 2  # two distinct pictures
    assert qwen_core.input_processor.pool.num_prepared > prepared  # the front end's worker prepared them


def test_the_server_over_a_process_core_answers_and_turns_503_when_it_dies(qwen_core):
    """`mmengine serve --engine-core process` in miniature: completions and /metrics through the core; a core
    killed while idle (no request in flight: no step notices it) turns the engine unhealthy, and /health and every
    new request (add_request's EngineDeadError) a 503 (engine_dead), within seconds. The last test of the Qwen
    core (it kills it)."""
    httpx = pytest.importorskip("httpx")
    from mmengine.entrypoints.api_server import ServerSettings
    from serve_helpers import running_server

    async_engine = AsyncMMEngine(qwen_core)
    pid = qwen_core.core_pid
    body = {"model": "tiny", "prompt": TEXT_PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        with running_server(async_engine, ServerSettings("tiny")) as server:
            answer = httpx.post(server.v1 + "/completions", json=body, timeout=60)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
            assert server.metrics()["mmengine_prompt_tokens_total"] > 0  # the core's counters, by a call
            assert httpx.get(server.base_url + "/health").status_code == 200
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            wait_until(lambda: httpx.get(server.base_url + "/health").status_code != 200, timeout_s=10)
            assert httpx.get(server.base_url + "/health").status_code == 503
            assert not async_engine.is_healthy
            refused = httpx.post(server.v1 + "/completions", json=body, timeout=60)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
            assert time.monotonic() - killed < 10
    finally:
        qwen_core.close()  # the core reaped, the preprocessing worker stopped
    assert not alive(pid)


def test_a_request_crosses_as_shared_copies_and_leaves_the_cached_tensors_as_they_were():
    """Sending moves a tensor's storage into shared memory in place; the front end sends copies instead, so
    the processor cache's tensors hold no descriptor (thousands of cached pictures would exhaust the limit)."""
    import torch

    from mmengine.core.request import MMItem, ProcessedPrompt
    from mmengine.engine.core_client import in_shared_memory
    from mmengine.engine.intake import PreparedRequest

    pixels = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)[:, :, ::2]  # not contiguous, as views can be
    item = MMItem("image", "h", 1, 2, {"pixel_values": pixels})
    prepared = PreparedRequest(ProcessedPrompt("p", [1, 0, 0, 2], [item]), greedy(1), None, None, "r")
    sent = in_shared_memory(prepared)
    copy = sent.processed.mm_items[0].encoder_inputs["pixel_values"]
    assert copy.is_shared() and not pixels.is_shared() and torch.equal(copy, pixels)
    assert prepared.processed.mm_items[0].encoder_inputs["pixel_values"] is pixels  # the original untouched
    assert in_shared_memory(sent).processed.mm_items[0].encoder_inputs["pixel_values"] is copy  # shared once
