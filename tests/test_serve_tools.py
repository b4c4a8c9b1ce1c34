"""Tool calling through the OpenAI API (tiny Qwen2.5-VL, whose template writes tools as the published
Qwen2.5 templates do): tool_choice "required" and a named function always produce valid calls
(grammar-enforced), streamed as tool_calls deltas too; a call and its result go back through the chat
template; the Hermes-style parser in units; bad tool fields are 400s naming them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import running_server

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.entrypoints.tools import ToolCallStream, parse_tool_calls
from mmengine.testing import tiny_qwen_vl_path

MODEL = "tiny-qwen"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    engine = MMEngine(str(tiny_qwen_vl_path()), device="cpu", dtype="float32", max_model_len=1024)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL)) as running:
        yield engine, running, openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)


def _check_calls(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in SCHEMAS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice_always_call_valid_functions(served):
    _, _, client = served
    for seed in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                max_tokens=200, temperature=1.0, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)
        named = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0,
                                               seed=seed, parallel_tool_calls=False,
                                               tool_choice={"type": "function", "function": {"name": "get_time"}})
        _check_calls(named.choices[0].message.tool_calls, only="get_time")
        assert len(named.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_arrive_as_deltas(served):
    _, _, client = served
    calls, finish, content = [], None, ""
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                max_tokens=200, temperature=1.0, seed=7, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            calls += delta.tool_calls or []
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content.strip() == ""
    assert [call.index for call in calls] == list(range(len(calls)))
    _check_calls(calls)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=7)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


def test_a_call_and_its_result_go_back_through_the_chat_template(served):
    engine, _, client = served
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    follow_up = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
    as_template_sees_it = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "content": "sunny, 21 degrees"}]
    prompt = engine.tokenizer.apply_chat_template(as_template_sees_it, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in prompt and '"name": "get_weather"' in prompt
    (expected,) = engine.generate(prompt, sampling_params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                  use_tqdm=False)
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert answer.choices[0].message.content == expected.text


def test_auto_offers_the_tools_in_the_prompt(served):
    engine, _, client = served
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})
    with_tools = engine.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert answer.usage.prompt_tokens == len(engine.tokenizer(with_tools)["input_ids"])
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    plain = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert none.usage.prompt_tokens == len(engine.tokenizer(plain)["input_ids"])


@pytest.mark.parametrize("fields, param, words", [
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", "'fly', which is not among"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools.0.function.colour", "not supported"),
    ({"tool_choice": "required", "guided_json": WEATHER}, "guided_json", "contradict"),  # response_format is not: test_serve_clients
    ({"tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "needs json_schema.schema"),  # a misshapen format is refused even on a forced turn
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "distinct"),
])
def test_bad_tool_fields_are_400s_naming_them(served, fields, param, words):
    _, running, _ = served
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, **fields}
    response = httpx.post(running.v1 + "/chat/completions", json={k: v for k, v in body.items() if v is not None}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_template_without_tools_refuses_them(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)  # tiny LLaVA: its template has no tools
    with running_server(AsyncMMEngine(engine), ServerSettings("tiny-llava")) as running:
        response = httpx.post(running.v1 + "/chat/completions", json={"model": "tiny-llava", "messages": MESSAGES,
                                                                      "tools": TOOLS, "max_tokens": 2}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_the_parser_on_whole_and_streamed_answers():
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"zone": 2}]
    assert parsed.content == "Let me check.\n\n<tool_call>\nnot json\n</tool_call>"
    assert parse_tool_calls("no calls").content == "no calls" and parse_tool_calls("no calls").tool_calls == []
    stream, content, calls = ToolCallStream(), "", []
    for i in range(0, len(text), 3):  # three characters at a time: tags arrive split
        piece, made = stream.feed(text[i:i + 3], final=i + 3 >= len(text))
        content += piece
        calls += made
    assert [c["function"]["name"] for c in calls] == ["get_time"] and calls[0]["index"] == 0
    assert content == "Let me check.\n\n<tool_call>\nnot json\n</tool_call>"
