"""/tokenize, /detokenize and /version in vLLM's shapes: a chat's count equals the usage of the same
chat request (a picture counts as its placeholder run), tokens round-trip through /detokenize, and
misuse is a 400 naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_helpers import MODEL_NAME, data_url, image_part, running_server

import mmengine
from mmengine import MMEngine
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.testing import make_test_image

PROMPT = "USER: count the boats on the river ASSISTANT:"


@pytest.fixture(scope="module")
def served(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, device="cpu", dtype="float32")
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as running:
        yield engine, running.base_url, openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)


def _post(base: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/{route}", json=body, timeout=60)


def test_a_prompt_round_trips_through_detokenize(served):
    engine, base, client = served
    answer = _post(base, "tokenize", {"model": MODEL_NAME, "prompt": PROMPT, "return_token_strs": True}).json()
    assert answer["tokens"] == engine.tokenizer(PROMPT)["input_ids"] and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 256 and len(answer["token_strs"]) == answer["count"]
    bare = _post(base, "tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"] != answer["tokens"]
    assert _post(base, "detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": PROMPT}
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1)
    assert completion.usage.prompt_tokens == answer["count"]


def test_a_chat_with_a_picture_counts_what_the_chat_request_computes(served):
    engine, base, client = served
    messages = [{"role": "user", "content": [image_part(data_url(make_test_image(3, size=(64, 48)))),
                                             {"type": "text", "text": "What is it?"}]}]
    answer = _post(base, "tokenize", {"model": MODEL_NAME, "messages": messages}).json()
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert answer["count"] == chat.usage.prompt_tokens
    image_id = engine.family.image_token_id
    assert answer["tokens"].count(image_id) == engine.family.max_tokens_per_item()  # the placeholder run, expanded


def test_version_and_misuse(served):
    _, base, _ = served
    assert httpx.get(f"{base}/version", timeout=30).json() == {"version": mmengine.__version__}
    cases = [
        ("tokenize", {"prompt": PROMPT, "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
        ("tokenize", {"prompt": PROMPT, "truncate": 3}, "truncate"),
        ("tokenize", {"model": "other", "prompt": PROMPT}, "model"),
        ("detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("detokenize", {"tokens": "abc"}, "tokens"),
    ]
    for route, body, param in cases:
        response = _post(base, route, body)
        assert response.status_code in (400, 404), (route, body, response.text)
        assert response.json()["error"]["param"] == param, response.text
    messages = [{"role": "user", "content": [image_part(data_url(make_test_image(4, size=(32, 32)))),
                                             {"type": "text", "text": "hi"}]}]
    refused = _post(base, "tokenize", {"messages": messages, "add_special_tokens": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "add_special_tokens"
