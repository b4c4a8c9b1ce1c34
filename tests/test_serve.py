"""`mmengine serve` end to end: a real server on a loopback port, driven with the `openai` client and
httpx. Answers equal MMEngine.chat/generate offline (greedy), streams concatenate to the whole answer,
usage counts match, a second turn reuses the KV and encoder caches, 32 concurrent streams each get
their own answer, and clients that go away free everything they held."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from serve_helpers import API_KEY, CPU_FP32, HEADERS, MODEL_NAME, data_url, image_part, running_server
from serve_fixtures import server_fixtures

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine, RequestStream
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.testing import make_test_image

ENGINE_OPTIONS = CPU_FP32


server, offline = server_fixtures()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


def _user(image, question: str) -> dict:
    return {"role": "user", "content": [image_part(data_url(image)), {"type": "text", "text": question}]}


def _offline_user(question: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}


def _greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def test_chat_with_a_data_url_image_answers_as_offline_chat(client, offline):
    image = make_test_image(101)
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=[_user(image, "What is in the picture?")], max_tokens=12, temperature=0
    )
    (expected,) = offline.chat([_offline_user("What is in the picture?")], images=[image], sampling_params=_greedy(12),
                               use_tqdm=False)
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text and choice.finish_reason == expected.finish_reason
    assert answer.model == MODEL_NAME and answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    usage = answer.usage
    assert usage.prompt_tokens == len(expected.prompt_token_ids) > 16  # the image's placeholders count
    assert usage.completion_tokens == len(expected.token_ids) == 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # a picture this server has not seen


def _pace_steps_on_the_streams(engine: MMEngine, monkeypatch) -> None:
    """No step while a streamed request's last output is unread by its stream: a stream that falls behind hands its
    reader (the server's writer) the outputs so far as one delta, by design, and a loaded machine that keeps the
    server's event loop off the CPU meanwhile could make one delta of a whole short answer."""
    unread, changed = set(), threading.Condition()
    step, delta = engine.step, RequestStream._delta

    def paced_step():
        with changed:
            assert changed.wait_for(lambda: not unread, 30)
        outputs = step()
        with changed:
            unread.update(output.request_id for output in outputs if output.token_ids and not output.finished)
        return outputs

    def read_delta(self, output):
        with changed:
            unread.discard(self.request_id)
            changed.notify_all()
        return delta(self, output)

    monkeypatch.setattr(engine, "step", paced_step)
    monkeypatch.setattr(RequestStream, "_delta", read_delta)


def test_stream_deltas_concatenate_to_the_whole_answer(client, server, monkeypatch):
    image = make_test_image(102)
    request = dict(model=MODEL_NAME, messages=[_user(image, "Describe it.")], max_tokens=14, temperature=0)
    whole = client.chat.completions.create(**request)
    _pace_steps_on_the_streams(server.async_engine.engine, monkeypatch)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for piece in content if piece) > 1  # it did stream, not one blob
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage  # the usage chunk comes last, with no choices
    assert not chunks[-1].choices and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same request again: its prefix is cached

    # The wire format: SSE `data:` lines of chat.completion.chunk objects, then `data: [DONE]`.
    with httpx.stream("POST", server.v1 + "/chat/completions", json={**request, "stream": True}, headers=HEADERS,
                      timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert {event["object"] for event in events} == {"chat.completion.chunk"}
    assert len({event["id"] for event in events}) == 1
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == whole.choices[0].message.content


def test_completions_match_generate_with_a_stop_string(client, offline):
    prompt = "USER: Tell me about the sea. ASSISTANT:"
    (plain,) = offline.generate(prompt, sampling_params=_greedy(16, ignore_eos=True), use_tqdm=False)
    stop = plain.text[len(plain.text) // 2 : len(plain.text) // 2 + 2]
    (expected,) = offline.generate(prompt, sampling_params=_greedy(16, ignore_eos=True, stop=[stop]), use_tqdm=False)
    assert expected.finish_reason == "stop"
    request = dict(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    whole = client.completions.create(**request)
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == len(expected.token_ids)
    streamed = list(client.completions.create(**request, stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text  # nothing past the stop string leaked
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_second_turn_about_the_same_picture_reuses_the_caches(client, server, offline):
    image = make_test_image(103)
    first_turn = [_user(image, "What is this?")]
    before = server.metrics()
    first = client.chat.completions.create(model=MODEL_NAME, messages=first_turn, max_tokens=8, temperature=0)
    middle = server.metrics()
    assert middle["mmengine_encoder_runs_total"] == before["mmengine_encoder_runs_total"] + 1

    answer = first.choices[0].message.content
    second_turn = [*first_turn, {"role": "assistant", "content": answer}, {"role": "user", "content": "And its colours?"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=second_turn, max_tokens=8, temperature=0)
    after = server.metrics()
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert after["mmengine_encoder_runs_total"] == middle["mmengine_encoder_runs_total"]  # no second encoder run
    assert after["mmengine_encoder_cache_hits_total"] > middle["mmengine_encoder_cache_hits_total"]
    assert after["mmengine_prefix_cache_hits_total"] > middle["mmengine_prefix_cache_hits_total"]

    offline_turns = [_offline_user("What is this?"), {"role": "assistant", "content": answer},
                     {"role": "user", "content": "And its colours?"}]
    (expected,) = offline.chat(offline_turns, images=[image], sampling_params=_greedy(8), use_tqdm=False)
    assert second.choices[0].message.content == expected.text


def test_32_concurrent_streaming_clients_each_get_their_own_answer(server, offline):
    images = [make_test_image(110 + i) for i in range(4)]
    questions = [f"Question {i}: what do you see?" for i in range(32)]

    async def one(client: openai.AsyncOpenAI, index: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=[_user(images[index % 4], questions[index])], max_tokens=8, temperature=0,
            stream=True,
        )
        text, finish = [], None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(text), finish

    async def all_clients() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), timeout=180)

    answers = asyncio.run(all_clients())
    expected = offline.chat([[_offline_user(q)] for q in questions], images=[[images[i % 4]] for i in range(32)],
                            sampling_params=_greedy(8), use_tqdm=False)
    assert [text for text, _ in answers] == [e.text for e in expected]
    assert [finish for _, finish in answers] == [e.finish_reason for e in expected]
    assert len({text for text, _ in answers}) > 1


def test_clients_that_go_away_leave_every_kv_block_free(server, monkeypatch):
    """Eight streams left mid-answer, and two clients that stop waiting for a whole answer: the steps are
    held while those two wait, so they leave before it can come whatever the machine's speed."""
    long_request = dict(model=MODEL_NAME, max_tokens=400, temperature=0, ignore_eos=True)
    image_url = data_url(make_test_image(120))
    before = server.metrics()
    engine = server.async_engine.engine
    steps_run = threading.Event()
    steps_run.set()
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (steps_run.wait(60), step())[1])

    async def stream_then_leave(client: httpx.AsyncClient, index: int) -> int:
        body = {**long_request, "stream": True,
                "messages": [{"role": "user", "content": [image_part(image_url), {"type": "text", "text": f"Story {index}"}]}]}
        events = 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
        return events

    async def wait_then_leave(client: httpx.AsyncClient) -> None:
        body = {**long_request, "messages": [{"role": "user", "content": "A long story, please."}]}
        # Only the read is short: a connect or pool wait on a loaded machine must not end the client
        # before the server has its request (CI once saw a ConnectTimeout here).
        leave_while_waiting = httpx.Timeout(60, read=0.3)
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=body, timeout=leave_while_waiting)

    async def clients() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=60) as client:
            await asyncio.wait_for(asyncio.gather(*(stream_then_leave(client, i) for i in range(8))), timeout=120)
            steps_run.clear()
            try:
                await asyncio.wait_for(asyncio.gather(wait_then_leave(client), wait_then_leave(client)), timeout=120)
            finally:
                steps_run.set()

    asyncio.run(clients())
    # A client that timed out may have left before the server even queued its request (its prompt waits
    # for the worker pool behind the pictures): wait for the outcome, all 10 seen going away.
    gone = before["mmengine_client_disconnects_total"] + 10
    after = server.wait_until_idle(until=lambda metrics: metrics["mmengine_client_disconnects_total"] >= gone)
    assert after["mmengine_requests_in_flight"] == 0 and after["mmengine_requests_running"] == 0
    assert after["mmengine_client_disconnects_total"] - before["mmengine_client_disconnects_total"] == 10
    assert after["mmengine_kv_blocks_free"] == after["mmengine_kv_blocks_total"]
    assert after["mmengine_encoder_cache_referenced"] == 0
    generated = after["mmengine_generation_tokens_total"] - before["mmengine_generation_tokens_total"]
    assert generated < 10 * 400 / 2  # aborted early, not run to their 400 tokens


def test_models_health_and_metrics(server):
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    assert httpx.post(server.v1 + "/chat/completions", json=chat, headers=HEADERS, timeout=60).status_code == 200
    models = httpx.get(server.v1 + "/models", headers=HEADERS).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME] and models["data"][0]["max_model_len"] == 512
    assert httpx.get(server.base_url + "/health").status_code == 200
    metrics = server.metrics()
    for name in ("mmengine_time_to_first_token_seconds_count", "mmengine_inter_token_latency_seconds_count",
                 "mmengine_e2e_request_latency_seconds_count"):
        assert metrics[name] > 0
    stats = server.async_engine.engine.stats()
    for name in stats:  # every stats() entry is exported under its own name
        assert f"mmengine_{name}" in metrics or f"mmengine_{name}_total" in metrics, name
    assert metrics['mmengine_api_requests_total{endpoint="chat",finish_reason="length"}'] > 0


def test_cache_salt_mm_uuids_and_seed_are_honoured(client, server):
    def ask(image, **extra):
        return client.chat.completions.create(model=MODEL_NAME, messages=[_user(image, "Salted question?")],
                                              max_tokens=4, temperature=0, extra_body=extra)

    image = make_test_image(130)
    assert ask(image, cache_salt="alice").usage.prompt_tokens_details.cached_tokens == 0
    assert ask(image, cache_salt="alice").usage.prompt_tokens_details.cached_tokens > 0
    assert ask(image, cache_salt="bob").usage.prompt_tokens_details.cached_tokens == 0  # salts never share blocks

    before = server.metrics()["mmengine_encoder_runs_total"]
    first = ask(make_test_image(131), mm_uuids=["picture-131"])
    again = ask(make_test_image(132), mm_uuids=["picture-131"], cache_salt="other")  # same id: taken as the same image
    assert server.metrics()["mmengine_encoder_runs_total"] == before + 1
    assert again.choices[0].message.content == first.choices[0].message.content

    sampled = [client.completions.create(model=MODEL_NAME, prompt="USER: Sing. ASSISTANT:", max_tokens=8,
                                         temperature=1.0, top_p=0.9, seed=seed, extra_body={"top_k": 50}).choices[0].text
               for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe"])  # LLaVA: the tests above
def test_each_family_serves_image_chats_as_offline_chat(family_checkpoint, name):
    """The server is family-agnostic: a Qwen chat with two images of different sizes, streamed,
    answers as offline chat, and a second turn about the same pictures reuses the caches."""
    path = str(family_checkpoint(name))
    images = [make_test_image(201, size=(150, 150)), make_test_image(202, size=(100, 60))]
    question = "Compare them."
    content = [image_part(data_url(images[0])), image_part(data_url(images[1])), {"type": "text", "text": question}]
    offline_content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": question}]
    with running_server(AsyncMMEngine(MMEngine(path, **ENGINE_OPTIONS)), ServerSettings(MODEL_NAME, api_key=API_KEY)) as running:
        with openai.OpenAI(base_url=running.v1, api_key=API_KEY, max_retries=0, timeout=60) as client:
            stream = client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0, stream=True
            )
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            again = client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
            )
    (expected,) = MMEngine(path, **ENGINE_OPTIONS).chat(
        [{"role": "user", "content": offline_content}], images=images, sampling_params=_greedy(8), use_tqdm=False
    )
    assert text == expected.text == again.choices[0].message.content
    assert again.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
