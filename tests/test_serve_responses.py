"""POST /v1/responses through the openai client: the same greedy text as the same chat completion
(with a picture too), parse(text_format=Model) gives the parsed object, the streamed events assemble
the same text, a forced function tool gives a function_call item, and what is not honoured (or is
misshapen: an input item, a message's content or a content part, text.format) is a 400 naming it."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest
from serve_helpers import data_url, running_server

from mmengine import MMEngine
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.testing import make_test_image, tiny_qwen_vl_path

MODEL = "tiny-qwen"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}


class Verdict(pydantic.BaseModel):
    colour: str = pydantic.Field(max_length=8)
    count: int = pydantic.Field(ge=0, le=9)


@pytest.fixture(scope="module")
def served():
    engine = MMEngine(str(tiny_qwen_vl_path()), device="cpu", dtype="float32", max_model_len=1024)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL)) as running:
        yield engine, running, openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)


def test_text_and_a_picture_answer_as_the_same_chat(served):
    _, _, client = served
    url = data_url(make_test_image(11, size=(64, 48)))
    response = client.responses.create(
        model=MODEL, instructions="Answer briefly.", max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                            {"type": "input_text", "text": "What is in the picture?"}]}])
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "What is in the picture?"}]}])
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    plain = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=4, temperature=0)
    same = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=4,
                                          temperature=0)
    assert plain.output_text == same.choices[0].message.content


def test_parse_with_a_pydantic_model_gives_the_object(served):
    _, _, client = served
    parsed = client.responses.parse(model=MODEL, input="Describe it as JSON.", text_format=Verdict, max_output_tokens=64,
                                    temperature=1.0, extra_body={"seed": 3})
    assert isinstance(parsed.output_parsed, Verdict)
    assert Verdict.model_validate_json(parsed.output_text) == parsed.output_parsed
    assert ": " not in parsed.output_text and "\n" not in parsed.output_text  # compact JSON


def test_streamed_events_assemble_the_same_text(served):
    _, _, client = served
    whole = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=12, temperature=0)
    kinds, deltas, final = [], [], None
    for event in client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=12, temperature=0, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_function_tool_gives_a_function_call_item(served):
    _, _, client = served
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER,
              "strict": True}]
    response = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                       tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
                                       temperature=1.0, extra_body={"seed": 1})
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" and call.call_id.startswith("call_") for call in calls)
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    # the call and its result go round the conversation
    follow = client.responses.create(model=MODEL, tools=tools, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > response.usage.input_tokens


@pytest.mark.parametrize("fields,param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),  # [] and null ask for nothing: accepted (test_serve_clients)
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,", "detail": "low"}]}]}, "input"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_is_not_honoured_is_a_400_naming_it(served, fields, param):
    _, running, _ = served
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    answer = httpx.post(f"{running.v1}/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


@pytest.mark.parametrize("fields,param,where", [
    ({"input": [{"role": "user", "content": {"type": "input_text", "text": "hi"}}]}, "input", "input[0].content"),
    ({"input": [{"role": "user", "content": 7}]}, "input", "input[0].content"),
    ({"input": [{"role": "user", "content": ["hi"]}]}, "input", "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, None]}]}, "input", "input[0].content[1]"),
    ({"input": [{"role": "user", "content": "hi"}, "hi"]}, "input", "input[1]"),
    ({"input": [{"role": ["user"], "content": "hi"}]}, "input", "role"),
    ({"text": {"format": "json_object"}}, "text.format", "text.format"),
    ({"text": {"format": ["json_object"]}}, "text.format", "text.format"),
])
def test_a_misshapen_input_or_format_is_a_400_naming_where(served, fields, param, where):
    _, running, _ = served
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    answer = httpx.post(f"{running.v1}/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and where in error["message"], answer.text
