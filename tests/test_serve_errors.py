"""Bad requests to `mmengine serve` get OpenAI's error JSON with the right status and a message naming
what was wrong, while a good request running at the same time is undisturbed; an overloaded server
answers 503 with Retry-After."""

from __future__ import annotations

import asyncio
import base64
import threading

import httpx
import pytest
from serve_helpers import API_KEY, MODEL_NAME, data_url, image_part, running_server

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.testing import make_test_image

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GOOD_IMAGE = data_url(make_test_image(201))


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return MMEngine(str(checkpoint_dir()), max_model_len=256, limit_mm_per_prompt={"image": 2})


@pytest.fixture(scope="module")
def server(engine):
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME, api_key=API_KEY)) as running:
        yield running


def _chat(*parts, **fields) -> dict:
    content = [*parts, {"type": "text", "text": "What is it?"}]
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def _data(payload: bytes, media_type: str = "image/png") -> dict:
    return image_part(f"data:{media_type};base64," + base64.b64encode(payload).decode())


CHAT = "/v1/chat/completions"
# (case, method, path, JSON body or raw bytes, headers, status, error code, param, words the message must hold)
BAD_REQUESTS = [
    ("corrupt image", "POST", CHAT, _chat(_data(b"this is not a picture")), HEADERS, 400, "invalid_image", "messages", "image 0"),
    ("bad base64", "POST", CHAT, _chat(image_part("data:image/png;base64,@@@@")), HEADERS, 400, "invalid_image_url",
     "messages", "base64"),
    ("not an image type", "POST", CHAT, _chat(_data(b"hi", "text/plain")), HEADERS, 400, "invalid_image_url", "messages",
     "text/plain"),
    ("too many images", "POST", CHAT, _chat(*[image_part(GOOD_IMAGE)] * 3), HEADERS, 400, "too_many_images", "messages",
     "at most 2"),
    ("prompt too long", "POST", CHAT, _chat(image_part(GOOD_IMAGE), max_tokens=1000), HEADERS, 400,
     "context_length_exceeded", "messages", "max_model_len=256"),
    ("negative temperature", "POST", CHAT, _chat(temperature=-1), HEADERS, 400, "invalid_value", "temperature", "temperature"),
    ("top_p zero", "POST", CHAT, _chat(top_p=0), HEADERS, 400, "invalid_value", "top_p", "top_p"),
    ("zero max tokens", "POST", CHAT, _chat(max_completion_tokens=0), HEADERS, 400, "invalid_value",
     "max_completion_tokens", "max_completion_tokens must be an int >= 1"),
    ("empty stop string", "POST", CHAT, _chat(stop=[""]), HEADERS, 400, "invalid_value", "stop", "stop"),
    ("negative seed", "POST", CHAT, _chat(seed=-1), HEADERS, 400, "invalid_value", "seed", "seed"),
    ("n beyond the limit", "POST", CHAT, _chat(n=17), HEADERS, 400, "invalid_value", "n", "n must be in 1..16"),
    ("an unknown field", "POST", CHAT, _chat(frobnicate=1), HEADERS, 400, "unsupported_parameter", "frobnicate",
     "frobnicate is not supported"),
    ("top_logprobs over 20", "POST", CHAT, _chat(logprobs=True, top_logprobs=21), HEADERS, 400, "invalid_value",
     "top_logprobs", "0..20"),
    ("top_logprobs without logprobs", "POST", CHAT, _chat(top_logprobs=2), HEADERS, 400, "invalid_value", "top_logprobs",
     "logprobs=true"),
    ("presence_penalty out of range", "POST", CHAT, _chat(presence_penalty=3), HEADERS, 400, "invalid_value",
     "presence_penalty", "[-2, 2]"),
    ("a regex that does not compile", "POST", CHAT, _chat(guided_regex="a(b"), HEADERS, 400, "invalid_value",
     "guided_regex", "unclosed group"),
    ("an invalid JSON schema", "POST", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}), HEADERS, 400, "invalid_value", "response_format", "strin"),
    ("a json_schema without its schema", "POST", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x"}}), HEADERS, 400, "invalid_value", "response_format.json_schema", "json_schema.schema"),
    ("an unknown response_format type", "POST", CHAT, _chat(response_format={"type": "xml"}), HEADERS, 400, "invalid_type",
     "response_format.type", "json_schema"),
    ("two constraints at once", "POST", CHAT, _chat(guided_regex="a", guided_choice=["a"]), HEADERS, 400, "invalid_value",
     "guided_choice", "one way"),
    ("temperature of the wrong type", "POST", CHAT, _chat(temperature="hot"), HEADERS, 400, "invalid_type", "temperature",
     "temperature"),
    ("unknown model", "POST", CHAT, {**_chat(), "model": "gpt-9"}, HEADERS, 404, "model_not_found", "model", "gpt-9"),
    ("bad JSON", "POST", CHAT, b'{"model": "tiny-llava", "messages": [', HEADERS, 400, "invalid_json", None, "not valid JSON"),
    ("no messages field", "POST", CHAT, {"model": MODEL_NAME}, HEADERS, 400, "missing_required_parameter", "messages",
     "messages"),
    ("empty messages", "POST", CHAT, {"model": MODEL_NAME, "messages": []}, HEADERS, 400, "invalid_value", "messages",
     "non-empty"),
    ("unknown role", "POST", CHAT, {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "hi"}]}, HEADERS, 400,
     "invalid_value", "messages", "robot"),
    ("unknown content part", "POST", CHAT, _chat({"type": "audio_url", "audio_url": {"url": "x"}}), HEADERS, 400,
     "invalid_value", "messages", "audio_url"),
    ("http image URL", "POST", CHAT, _chat(image_part("http://127.0.0.1:9/cat.png")), HEADERS, 400,
     "remote_media_disabled", "messages", "data: URL"),
    ("file URL without an allowed directory", "POST", CHAT, _chat(image_part("file:///etc/hostname")), HEADERS, 400,
     "local_media_disabled", "messages", "--allowed-local-media-path"),
    ("image marker without an image", "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "USER: <image> hi"},
     HEADERS, 400, "image_count_mismatch", "prompt", "0 image(s)"),
    ("an empty list of prompts", "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": []}, HEADERS, 400, "invalid_value",
     "prompt", "empty list"),
    ("a token id outside the vocabulary", "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": [[1, 2], [1, 10**9]]},
     HEADERS, 400, "invalid_value", "prompt", "prompt 1: prompt_token_ids[1] = 1000000000 is outside the vocabulary"),
    ("wrong API key", "POST", CHAT, _chat(), {"Authorization": "Bearer nope"}, 401, "invalid_api_key", None, "API key"),
    ("no API key", "GET", "/v1/models", None, {}, 401, "invalid_api_key", None, "API key"),
    ("unknown route", "GET", "/v1/nothing-here", None, HEADERS, 404, "not_found", None, "/v1/nothing-here"),
    ("wrong method", "GET", CHAT, None, HEADERS, 405, "method_not_allowed", None, "GET"),
]
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error"}


def test_every_bad_request_gets_its_status_and_error_json_while_a_good_one_streams(server, engine):
    good_body = {**_chat(image_part(GOOD_IMAGE)), "max_tokens": 24, "temperature": 0, "stream": True}

    async def good(client: httpx.AsyncClient) -> str:
        pieces = []
        async with client.stream("POST", CHAT, json=good_body, headers=HEADERS) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    pieces.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"].get("content", ""))
        return "".join(pieces)

    async def bad(client: httpx.AsyncClient, method, path, body, headers) -> httpx.Response:
        if isinstance(body, bytes):
            return await client.request(method, path, content=body, headers={**headers, "content-type": "application/json"})
        return await client.request(method, path, json=body, headers=headers)

    async def everything():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(
                good(client), *(bad(client, method, path, body, headers) for _, method, path, body, headers, *_ in BAD_REQUESTS)
            ), timeout=120)

    # counted from here: other tests of this module may have run first on this server (any order)
    errors_before = server.metrics().get('mmengine_api_errors_total{status="400"}', 0.0)
    good_text, *responses = asyncio.run(everything())
    failures = []
    for (case, _, _, _, _, status, code, param, words), response in zip(BAD_REQUESTS, responses):
        error = response.json().get("error", {})
        expected = {"status": status, "type": ERROR_TYPES[status], "code": code, "param": param}
        got = {"status": response.status_code, "type": error.get("type"), "code": error.get("code"), "param": error.get("param")}
        if got != expected or words not in error.get("message", ""):
            failures.append(f"{case}: expected {expected} with {words!r} in the message, got {got}: {error.get('message')!r}")
    assert not failures, "\n".join(failures)

    (expected,) = engine.chat(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        images=[make_test_image(201)], sampling_params=SamplingParams(max_tokens=24, temperature=0), use_tqdm=False,
    )
    assert good_text == expected.text
    after = server.wait_until_idle()
    assert after["mmengine_kv_blocks_free"] == after["mmengine_kv_blocks_total"]  # the refused ones hold nothing
    assert after['mmengine_api_errors_total{status="400"}'] - errors_before == sum(1 for case in BAD_REQUESTS if case[5] == 400)
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_an_overloaded_server_answers_503_with_retry_after(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=512, max_num_seqs=1)
    async_engine = AsyncMMEngine(engine, max_queued_requests=1)
    body = {"model": MODEL_NAME, "prompt": "USER: Tell me everything. ASSISTANT:", "temperature": 0, "ignore_eos": True}
    # The test holds the engine's steps while it fills the queue, so the first request cannot finish
    # before the third arrives, however fast the machine.
    steps_may_run = threading.Event()
    steps_may_run.set()
    step = engine.step

    def held_step():
        steps_may_run.wait(timeout=60)
        return step()

    engine.step = held_step

    async def scenario(base_url: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as running:
                async for line in running.aiter_lines():  # the first request runs (max_num_seqs=1)...
                    if line.startswith("data: {"):
                        break
                steps_may_run.clear()
                try:
                    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as queued:
                        assert queued.status_code == 200  # ...the second is queued behind it...
                        assert async_engine.num_queued == 1
                        return await client.post("/v1/completions", json={**body, "max_tokens": 2})  # ...the third is refused
                finally:
                    steps_may_run.set()

    with running_server(async_engine, ServerSettings(MODEL_NAME)) as server:
        refused = asyncio.run(asyncio.wait_for(scenario(server.base_url), timeout=120))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "overloaded" and error["type"] == "service_unavailable_error"
        assert "max_queued_requests=1" in error["message"]
        server.wait_until_idle()
        retried = httpx.post(server.base_url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
        assert retried.status_code == 200 and retried.json()["usage"]["completion_tokens"] == 2


def test_an_unexpected_failure_fails_only_its_request(checkpoint_dir, monkeypatch):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    process = engine.input_processor.process

    def fragile(prompt, *args, **kwargs):
        if "boom" in prompt:
            raise RuntimeError("a bug met this request")
        return process(prompt, *args, **kwargs)

    monkeypatch.setattr(engine.input_processor, "process", fragile)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as server:
        def complete(prompt: str) -> httpx.Response:
            return httpx.post(server.v1 + "/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3},
                              timeout=60)

        failed = complete("USER: boom ASSISTANT:")
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["code"] == "internal_error" and "a bug met this request" in error["message"]
        assert complete("USER: hello ASSISTANT:").status_code == 200
        assert httpx.get(server.base_url + "/health").status_code == 200


def test_a_list_of_prompts_that_meets_an_unexpected_failure_leaves_none_of_them_queued(checkpoint_dir, monkeypatch):
    """The second prompt of a completions list meets a bug: the first, queued already, is aborted with it
    rather than left running for nobody (as a typed error's list already was)."""
    from books import assert_books_consistent

    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    process, step = engine.input_processor.process, engine.step
    stepping = threading.Event()

    def fragile(prompt, *args, **kwargs):
        if "boom" in prompt:
            raise RuntimeError("a bug met this request")
        return process(prompt, *args, **kwargs)

    def held_step():  # no step completes before the answer is read: the first prompt cannot finish on its own
        assert stepping.wait(30)
        return step()

    monkeypatch.setattr(engine.input_processor, "process", fragile)
    monkeypatch.setattr(engine, "step", held_step)
    body = {"model": MODEL_NAME, "prompt": ["USER: hello ASSISTANT:", "USER: boom ASSISTANT:"], "max_tokens": 40,
            "ignore_eos": True}
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as server:
        failed = httpx.post(server.v1 + "/completions", json=body, timeout=60)
        in_flight = server.async_engine.num_in_flight
        stepping.set()
        server.wait_until_idle()
        assert failed.status_code == 500 and "a bug met this request" in failed.json()["error"]["message"]
        assert in_flight == 0
        assert engine.stats()["generation_tokens"] < 40  # aborted, not run to its end
        assert_books_consistent(engine)
        again = httpx.post(server.v1 + "/completions", json={**body, "prompt": "USER: hello ASSISTANT:", "max_tokens": 3}, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3


def test_a_dead_engine_loop_fails_health_and_requests(checkpoint_dir, monkeypatch):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)

    def broken() -> bool:
        raise RuntimeError("the step loop is broken")

    monkeypatch.setattr(engine, "has_unfinished_requests", broken)
    body = {"model": MODEL_NAME, "prompt": "USER: hi ASSISTANT:", "max_tokens": 3}
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as server:
        assert httpx.get(server.base_url + "/health").status_code == 200
        for _ in range(2):  # the request that meets the dying loop, and one after
            answer = httpx.post(server.v1 + "/completions", json=body, timeout=60)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_dead"
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503 and "the step loop is broken" in health.json()["error"]["message"]
        assert server.metrics()["mmengine_engine_healthy"] == 0


# A value other than the default for OpenAI's request fields (a field not listed gets "x").
FIELD_SAMPLES = {
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "logit_bias": {"5": 1.0}, "logprobs": True,
    "max_completion_tokens": 3, "max_tokens": 3, "metadata": {"k": "v"}, "modalities": ["text"], "n": 2,
    "parallel_tool_calls": False, "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5,
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "seed": 1, "service_tier": "flex", "stop": ["x"],
    "store": True, "stream_options": {"include_usage": True}, "temperature": 0.5, "tool_choice": "none",
    "tools": [{"type": "function", "function": {"name": "f"}}], "top_logprobs": 2, "top_p": 0.5, "user": "u",
    "best_of": 2, "echo": True, "suffix": "x", "web_search_options": {},
}


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_every_openai_request_field_is_honoured_or_refused_by_name(server, endpoint):
    import typing

    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    params = (chat_create_params if endpoint == "chat" else completion_create_params).CompletionCreateParamsBase
    base = (_chat() if endpoint == "chat" else {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3})
    verdicts = {}
    for name in sorted(typing.get_type_hints(params)):
        if name in ("model", "messages", "prompt"):
            continue
        body = {**base, name: FIELD_SAMPLES.get(name, "x")}
        response = httpx.post(server.base_url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions"),
                              json=body, headers=HEADERS, timeout=60)
        if response.status_code == 200:
            verdicts[name] = "honoured"
            continue
        error = response.json()["error"]
        assert response.status_code == 400 and (error["param"] or "").split(".")[0] == name, (name, response.text)
        verdicts[name] = "refused"
    assert verdicts.get("response_format", "honoured") == "honoured" and verdicts.get("n") == "honoured"
    assert verdicts["logprobs"] == "honoured" and verdicts["presence_penalty"] == "honoured"
    assert verdicts["logit_bias"] == "honoured"
