"""The OpenAI API's structured output, n > 1 / best_of and penalties, through the real `openai`
client against a real server (tiny Qwen2.5-VL): every json_schema answer validates, greedy and
sampled, streamed and whole, in a batch with unconstrained requests; guided_* extras; n samples share
one prefill and equal n separately seeded requests."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from serve_helpers import data_url, image_part, running_server

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.testing import make_test_image, tiny_qwen_vl_path
from mmengine.testing.schemas import SCHEMAS

MODEL = "tiny-qwen"
PICTURE = make_test_image(11, size=(56, 56))


@pytest.fixture(scope="module")
def server():
    engine = MMEngine(str(tiny_qwen_vl_path()), device="cpu", dtype="float32", max_model_len=1024)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL)) as running:
        yield running


def _messages(text: str, picture: bool = True) -> list[dict]:
    content = [image_part(data_url(PICTURE))] if picture else []
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def test_every_json_schema_answer_validates_streamed_or_whole_in_a_mixed_batch(server):
    async def one(client: openai.AsyncOpenAI, i: int, name: str) -> tuple[str, str, str]:
        sampled = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}
        kwargs = dict(model=MODEL, messages=_messages(f"Fill in {name}."), max_tokens=300, response_format=_schema_format(name),
                      **sampled)
        if i % 3 == 0:
            text, finish = "", None
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            return name, text, finish
        answer = await client.chat.completions.create(**kwargs)
        return name, answer.choices[0].message.content, answer.choices[0].finish_reason

    async def free(client: openai.AsyncOpenAI, i: int) -> str:
        answer = await client.chat.completions.create(model=MODEL, messages=_messages(f"Say anything {i}"), max_tokens=8,
                                                      temperature=0, extra_body={"ignore_eos": True})
        return answer.choices[0].message.content

    async def everything():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i, name) for i, name in enumerate(SCHEMAS)),
                                        *(free(client, i) for i in range(4)))

    *answers, = asyncio.run(everything())
    constrained, unconstrained = answers[:len(SCHEMAS)], answers[len(SCHEMAS):]
    for name, text, finish in constrained:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    alone = client.chat.completions.create(model=MODEL, messages=_messages("Say anything 0"), max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert unconstrained[0] == alone.choices[0].message.content  # the masks of the batch left it alone


def test_json_object_and_the_guided_extras(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    for seed in range(2):
        ask = dict(model=MODEL, messages=_messages("Answer.", picture=False), max_tokens=150, temperature=1.0, seed=seed)
        answer = client.chat.completions.create(response_format={"type": "json_object"}, **ask)
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
        answer = client.chat.completions.create(extra_body={"guided_choice": ["cat", "dog", "house"]}, **ask)
        assert answer.choices[0].message.content in ("cat", "dog", "house")
        answer = client.chat.completions.create(extra_body={"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}, **ask)
        assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", answer.choices[0].message.content)
        answer = client.completions.create(model=MODEL, prompt="List:", max_tokens=60, temperature=1.0, seed=seed,
                                           extra_body={"guided_grammar": 'start: item (";" item)*\nitem: /[a-z]{1,4}/'})
        assert re.fullmatch(r"[a-z]{1,4}(;[a-z]{1,4})*", answer.choices[0].text)
        answer = client.completions.create(model=MODEL, prompt="Data:", max_tokens=150, temperature=1.0, seed=seed,
                                           extra_body={"guided_json": SCHEMAS["form_fields"]})
        jsonschema.validate(json.loads(answer.choices[0].text), SCHEMAS["form_fields"])


def test_n_samples_share_one_prefill_and_equal_separately_seeded_requests(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    engine = server.async_engine.engine
    messages = _messages("Tell me a long story about this picture and everything in it. " * 3)
    stats = engine.stats()
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=40, n=4,
                                            extra_body={"ignore_eos": True})
    after = engine.stats()
    texts = [c.message.content for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3] and len(set(texts)) == 4
    prompt_tokens = answer.usage.prompt_tokens  # counted once, as OpenAI counts n > 1
    block = engine.config.cache_config.block_size
    tail = prompt_tokens - min(prompt_tokens // block * block, prompt_tokens - 1)  # the last partial block: per sample
    assert after["prefill_tokens_computed"] - stats["prefill_tokens_computed"] == prompt_tokens + 3 * tail
    assert after["encoder_runs"] - stats["encoder_runs"] <= 1
    assert answer.usage.completion_tokens == 4 * 6
    separate = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=40 + j,
                                               extra_body={"ignore_eos": True}).choices[0].message.content for j in range(4)]
    assert texts == separate


def test_best_of_answers_the_most_likely_samples(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    prompt = "Once upon a time"
    best = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=3, n=2, best_of=5,
                                     logprobs=0, extra_body={"ignore_eos": True})
    every = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=3, n=5, logprobs=0,
                                      extra_body={"ignore_eos": True})
    ranked = sorted(every.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 5 * 5  # every sample drawn is paid for


def test_penalties_reach_the_engine(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    offline = server.async_engine.engine
    prompt = "Repeat after me: the the the"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    texts = []
    # negative penalties and a repetition penalty below 1 make this random-weight model repeat itself
    for fields in ({"presence_penalty": -2.0}, {"frequency_penalty": -2.0}, {"extra_body": {"repetition_penalty": 0.5}}):
        extra = fields.pop("extra_body", {})
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True, **extra}, **fields)
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, **fields, **extra)
        assert answer.choices[0].text == offline.generate(prompt, sampling_params=params, use_tqdm=False)[0].text
        texts.append(answer.choices[0].text)
    assert all(text != plain.choices[0].text for text in texts)
