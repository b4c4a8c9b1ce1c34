"""The work one chat request costs the server on its way to the engine (issue 47, online throughput):
no trip to FastAPI's thread pool, one job on the engine's preprocessing pool (template, media, checks,
preprocessing and queueing together), with the answers and the typed errors of the longer path."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import threading
import time

import anyio.to_thread
import httpx
import pytest
from helpers import paced_on_first_reads
from starlette.background import BackgroundTask
from serve_helpers import CPU_FP32, HEADERS, MODEL_NAME, data_url, image_part
from serve_fixtures import server_fixtures

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.errors import InvalidInputError
from mmengine.testing import make_test_image
from mmengine.utils.collector_pace import SERVING_THRESHOLDS

ENGINE_OPTIONS = CPU_FP32


server, offline = server_fixtures()


def _chat(server, image, question: str, **extra) -> httpx.Response:
    messages = [{"role": "user", "content": [image_part(data_url(image)), {"type": "text", "text": question}]}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "temperature": 0} | extra
    return httpx.post(server.v1 + "/chat/completions", json=body, headers=HEADERS, timeout=60)


class _Counted:
    def __init__(self, monkeypatch, owner, name: str) -> None:
        self.calls = 0
        self.functions: list[str] = []
        original = getattr(owner, name)

        def counted(function, *args, **kwargs):
            self.calls += 1
            inner = getattr(function, "keywords", {}).get("function", getattr(function, "func", function))  # FastAPI's wrapper
            self.functions.append(getattr(inner, "__name__", repr(inner)))
            return original(function, *args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


def test_a_chat_request_makes_one_pool_trip_and_none_to_fastapis_thread_pool(server, offline, monkeypatch):
    threadpool = _Counted(monkeypatch, anyio.to_thread, "run_sync")  # what FastAPI runs a plain-def dependency on
    pool = _Counted(monkeypatch, server.async_engine, "run_in_pool")
    image = make_test_image(301)
    answer = _chat(server, image, "What is in the picture?")
    assert answer.status_code == 200, answer.text
    (expected,) = offline.chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}],
                               images=[image], sampling_params=SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert answer.json()["choices"][0]["message"]["content"] == expected.text
    assert answer.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert pool.calls == 1  # the template, the picture, the checks, preprocessing and queueing: one job
    assert threadpool.calls == 0  # the API-key check runs on the event loop
    # (below, /metrics, a plain def, runs on FastAPI's thread pool by design: it may wait for the engine's lock)
    finished_tasks = []  # the stream's background task (its aborts), which runs after its last byte
    run_task = BackgroundTask.__call__

    async def counted_task(task) -> None:
        await run_task(task)
        finished_tasks.append(task)

    monkeypatch.setattr(BackgroundTask, "__call__", counted_task)
    streamed = httpx.post(server.v1 + "/chat/completions", headers=HEADERS, timeout=60, json={
        "model": MODEL_NAME, "stream": True, "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": [image_part(data_url(image)), {"type": "text", "text": "What is in the picture?"}]}]})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert httpx.post(server.v1 + "/chat/completions", json={"model": MODEL_NAME, "messages": []}, timeout=60).status_code == 401
    deadline = time.monotonic() + 30
    while not finished_tasks and time.monotonic() < deadline:  # the background task has run (bounded)
        time.sleep(0.01)
    assert len(finished_tasks) == 1
    assert pool.calls == 2 and set(threadpool.functions) <= {"metrics"}  # nor its aborts, after the last byte


def test_errors_of_the_one_job_are_typed_and_leave_nothing_in_flight(server):
    image = make_test_image(302)
    corrupt = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
    bad_picture = httpx.post(server.v1 + "/chat/completions", headers=HEADERS, timeout=60, json={
        "model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [corrupt, {"type": "text", "text": "hi"}]}]})
    assert bad_picture.status_code == 400, bad_picture.text
    assert bad_picture.json()["error"]["param"] == "messages"
    too_long = _chat(server, image, "Describe it. " * 200)  # a prompt past max_model_len: the intake's check, in the job
    assert too_long.status_code == 400, too_long.text
    bad_uuids = _chat(server, image, "Describe it.", mm_uuids=["a", "b"])  # two ids for one picture
    assert bad_uuids.status_code == 400, bad_uuids.text
    metrics = server.wait_until_idle()
    assert metrics["mmengine_requests_in_flight"] == 0 and metrics["mmengine_requests_queued"] == 0
    assert _chat(server, image, "Describe it.").status_code == 200  # and the server goes on


def test_add_request_from_runs_the_prompt_maker_on_the_pool_and_unregisters_on_error(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), **ENGINE_OPTIONS)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, stop=["zz"])

    async def main() -> None:
        async with AsyncMMEngine(engine) as async_engine:
            seen = []

            def make_prompt():
                seen.append(threading.current_thread().name)
                return "USER: <image>\nWhat is it? ASSISTANT:", [make_test_image(303)]

            stream = await async_engine.add_request_from(make_prompt, greedy, request_id="one")
            assert seen[0].startswith("mmengine-preprocess") and len(seen) == 1 and stream.request_id == "one" and stream.sampling_params.stop == ["zz"]
            text = "".join([delta.text async for delta in stream])
            (expected,) = engine.generate("USER: <image>\nWhat is it? ASSISTANT:", images=[make_test_image(303)],
                                          sampling_params=greedy, use_tqdm=False)
            assert text == expected.text
            with pytest.raises(InvalidInputError):
                await async_engine.add_request_from(lambda: ("USER: <image>\nno picture ASSISTANT:", None), greedy)
            with pytest.raises(ZeroDivisionError):
                await async_engine.add_request_from(lambda: 1 / 0, greedy)
            assert async_engine.num_in_flight == 0 and async_engine.num_queued == 0

    asyncio.run(main())


def test_a_whole_answer_wakes_its_reader_twice_and_keeps_the_latency_metrics(server, checkpoint_dir):
    before = server.metrics()
    answer = _chat(server, make_test_image(304), "Describe it.", max_tokens=8, ignore_eos=True)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
    after = server.wait_until_idle()
    # the first token's time and the end's are observed as they came; the gaps between (7, unless the reader
    # was late for the first token and got two at once) as their mean
    assert after["mmengine_time_to_first_token_seconds_count"] - before["mmengine_time_to_first_token_seconds_count"] == 1
    assert 0 < after["mmengine_inter_token_latency_seconds_count"] - before["mmengine_inter_token_latency_seconds_count"] <= 7
    assert after["mmengine_e2e_request_latency_seconds_count"] - before["mmengine_e2e_request_latency_seconds_count"] == 1

    engine = MMEngine(str(checkpoint_dir()), **ENGINE_OPTIONS)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    prompt, picture = "USER: <image>\nWhat is it? ASSISTANT:", make_test_image(305)
    # A reader late for the first token gets it with the rest as one delta (by design): the readers start only once
    # both requests are queued, and a loaded machine can step the whole answer to its end meanwhile (it failed so).
    # So no step after a request's first token runs before its reader has read a delta.
    engine.step, first_read = paced_on_first_reads(engine.step)

    async def main() -> tuple[list, list]:
        async with AsyncMMEngine(engine) as async_engine:
            whole = await async_engine.add_request(prompt, [picture], params, whole_answer=True)
            streamed = await async_engine.add_request(prompt, [picture], params)

            async def read(stream) -> list:
                deltas = []
                async for delta in stream:
                    first_read.setdefault(stream.request_id, threading.Event()).set()
                    deltas.append(delta)
                return deltas

            return tuple(await asyncio.gather(read(whole), read(streamed)))

    whole, streamed = asyncio.run(main())
    assert len(whole) == 2 and sum(len(d.token_ids) for d in whole) == 9 and whole[0].token_ids  # woken twice
    assert "".join(d.text for d in whole) == "".join(d.text for d in streamed)
    assert [t for d in whole for t in d.token_ids] == [t for d in streamed for t in d.token_ids]
    assert whole[-1].finish_reason == streamed[-1].finish_reason == "length"
    assert whole[0].num_prompt_tokens == streamed[0].num_prompt_tokens


def test_a_whole_answer_is_stepped_as_generates_after_its_first_token(checkpoint_dir):
    """The engine hands back its first token's output and its final one, not one per step (its tokens
    decoded at the end, as generate() decodes its own); a whole answer left early still frees everything."""
    engine = MMEngine(str(checkpoint_dir()), **ENGINE_OPTIONS)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    prompt, picture = "USER: <image>\nWhat is shown? ASSISTANT:", make_test_image(306)
    handed_back: dict[str, int] = {}
    step = engine.step

    def counted_step():
        outputs = step()
        for output in outputs:
            handed_back[output.request_id] = handed_back.get(output.request_id, 0) + 1
        return outputs

    engine.step = counted_step

    async def main() -> tuple[list, list]:
        async with AsyncMMEngine(engine) as async_engine:
            whole = await async_engine.add_request(prompt, [picture], params, request_id="whole", whole_answer=True)
            streamed = await async_engine.add_request(prompt, [picture], params, request_id="streamed")

            async def read(stream) -> list:
                return [d async for d in stream]

            deltas = await asyncio.gather(read(whole), read(streamed))
            left = await async_engine.add_request(prompt, [picture], params, request_id="left", whole_answer=True)
            async for _ in left:
                break  # after the first token: aborted
            return deltas

    whole, streamed = asyncio.run(main())
    (expected,) = engine.generate(prompt, images=[picture], sampling_params=params, use_tqdm=False)
    assert "".join(d.text for d in whole) == "".join(d.text for d in streamed) == expected.text
    assert [t for d in whole for t in d.token_ids] == expected.token_ids
    assert handed_back["whole"] == 2 and handed_back["streamed"] == 9
    assert not engine.steps.owners and not engine.scheduler.requests
    assert [(o.request_id, o.finish_reason) for o in step()] == [("left", "abort")]  # (handed to the next step)
    assert not engine.has_unfinished_requests()


def test_the_one_process_server_runs_on_uvicorns_event_loop_with_its_start_up_frozen(server, monkeypatch):
    """`mmengine serve` (one process) serves on the loop uvicorn chooses (uvloop where installed), as each
    front end of the multi-process server does, not on asyncio's pure-Python one; its start-up objects are
    frozen out of the garbage collector's full passes first (utils/heap.py), and its young passes paced for
    serving (utils/collector_pace.py)."""
    from mmengine.entrypoints import api_server

    loops, access_logs = [], []

    async def serve(uvicorn_server, async_engine, *args, **kwargs) -> int:  # instead of serving: note the loop
        loops.append(type(asyncio.get_running_loop()))
        access_logs.append(uvicorn_server.config.access_log)
        return 0

    monkeypatch.setattr(api_server, "serve_until_engine_dies", serve)
    gc.unfreeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults
    try:
        api_server.run_server(server.async_engine, api_server.ServerSettings(MODEL_NAME), "127.0.0.1", 0)
        frozen, paced = gc.get_freeze_count(), gc.get_threshold()
        api_server.run_server(server.async_engine, api_server.ServerSettings(MODEL_NAME), "127.0.0.1", 0,
                              access_log=False)  # --disable-uvicorn-access-log
    finally:
        gc.unfreeze()  # (this test process goes on collecting as before)
        gc.set_threshold(*thresholds)
    expected = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    assert len(loops) == 2 and all(loop.__module__.split(".")[0] == expected for loop in loops)
    assert access_logs == [True, False]
    # start-up's objects are out of the collector's full passes before serving (a full pass over a served tiny
    # model's heap took 250 ms of CPU with the GIL held, every few hundred requests)
    assert frozen > 10_000
    # and its young passes run at the serving pace (utils/collector_pace.py: they found nothing to collect)
    assert paced == SERVING_THRESHOLDS
