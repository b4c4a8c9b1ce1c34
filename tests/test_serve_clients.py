"""The client libraries people build on, against one server on the tiny Qwen2.5-VL (issue 51, items 1-4),
each through the library itself where it is in the `test` extra, and through the exact request it sends:

- instructor's default TOOLS mode: a forced (named) call whose parameters are pydantic's schema with
  `$defs` / `$ref` (a nested model, a `List[Model]`), and `openai.pydantic_function_tool` forced, in chat
  and in the Responses API; a schema llguidance refuses is a 400 naming its function, never the grammar;
- the openai-agents SDK: an Agent with a function tool on `OpenAIResponsesModel` (`include: []`, a forced
  call and `text.format` on its first turn), run and streamed, with an `output_type`;
- litellm with a strict pydantic schema (objects that leave `additionalProperties` out are closed under
  `strict: true`, as vLLM reads it: a grammar-level check that a key outside the schema is refused, and
  end-to-end requests).

instructor is not in the `test` extra: 1.17 pins `jiter<0.15`, so installing it pulls the openai SDK back
from the current release to 3.3 under the whole suite. Its two requests are sent here as it sends them
(captured from instructor 1.17 with `from_openai(OpenAI(...))`), through the openai SDK; the test through
instructor itself runs where it is installed.

The tiny model is random: where a test needs a finished answer, it asks greedily (or with a seed) and
with bounded strings, through the same requests.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Annotated

import httpx
import jsonschema
import openai
import pydantic
import pytest
from serve_helpers import running_server

from mmengine import MMEngine
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_errors import APIError
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.entrypoints.response_format import closed_objects
from mmengine.entrypoints.responses_api import _renamed
from mmengine.sample.structured_output import StructuredOutputParams
from mmengine.testing import tiny_qwen_vl_path

MODEL = "tiny-qwen"


class Money(pydantic.BaseModel):
    amount: int
    currency: str


class Invoice(pydantic.BaseModel):
    customer: str
    total: Money


class LineItem(pydantic.BaseModel):
    name: str
    price: Money


class Order(pydantic.BaseModel):
    items: list[LineItem]


_MONEY = {"properties": {"amount": {"title": "Amount", "type": "integer"}, "currency": {"title": "Currency", "type": "string"}},
          "required": ["amount", "currency"], "title": "Money", "type": "object"}


def _instructor_request(name: str, parameters: dict) -> dict:
    """The body instructor 1.17 sends for `client.chat.completions.create(response_model=Model, max_tokens=200,
    messages=[...])` in its default mode (Mode.TOOLS), as captured."""
    return {"messages": [{"role": "user", "content": "Extract it."}], "model": MODEL, "max_tokens": 200,
            "tool_choice": {"type": "function", "function": {"name": name}},
            "tools": [{"type": "function", "function": {
                "name": name, "description": f"Correctly extracted `{name}` with all the required parameters with correct types",
                "parameters": parameters}}]}


INSTRUCTOR_INVOICE = _instructor_request("Invoice", {
    "$defs": {"Money": _MONEY},
    "properties": {"customer": {"title": "Customer", "type": "string"}, "total": {"$ref": "#/$defs/Money"}},
    "required": ["customer", "total"], "type": "object"})
INSTRUCTOR_ORDER = _instructor_request("Order", {
    "$defs": {"LineItem": {"properties": {"name": {"title": "Name", "type": "string"}, "price": {"$ref": "#/$defs/Money"}},
                           "required": ["name", "price"], "title": "LineItem", "type": "object"},
              "Money": _MONEY},
    "properties": {"items": {"items": {"$ref": "#/$defs/LineItem"}, "title": "Items", "type": "array"}},
    "required": ["items"], "type": "object"})
# what the tiny model needs to finish each of them: a greedy answer, a seeded one
FINISHING = {"Invoice": {"temperature": 0}, "Order": {"temperature": 1.0, "seed": 0}}


@pytest.fixture(scope="module")
def served():
    engine = MMEngine(str(tiny_qwen_vl_path()), device="cpu", dtype="float32", max_model_len=2048)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL)) as running:
        yield engine, running, openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)


def _post(running, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{running.v1}/{path}", json=body, timeout=120)


# -- item 1: a forced call whose parameters use $defs / $ref ---------------------------------------------


@pytest.mark.parametrize("request_body,model", [(INSTRUCTOR_INVOICE, Invoice), (INSTRUCTOR_ORDER, Order)],
                         ids=["nested-model", "list-of-models"])
def test_instructor_tools_mode_requests_call_with_defs(served, request_body, model):
    """instructor's exact request (a named call, pydantic's $defs) is served: first as sent (sampled, so
    the tiny model may run out of tokens), then with the sampling that finishes it, whose call validates."""
    _, running, client = served
    answer = _post(running, "chat/completions", request_body)
    assert answer.status_code == 200, answer.text
    for call in answer.json()["choices"][0]["message"].get("tool_calls") or []:
        jsonschema.validate(json.loads(call["function"]["arguments"]), request_body["tools"][0]["function"]["parameters"])
    name = request_body["tool_choice"]["function"]["name"]
    finished = client.chat.completions.create(**request_body, **FINISHING[name])
    choice = finished.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls[0].function.name == name
    model.model_validate_json(choice.message.tool_calls[0].function.arguments)


def test_instructor_itself_in_tools_mode(served):
    """The same through instructor (when it is installed; see the module's docstring)."""
    instructor = pytest.importorskip("instructor", reason="instructor is not in the test extra (it pins jiter<0.15, which "
                                     "pulls the openai SDK back to 3.3); its exact requests are sent above")
    _, running, _ = served
    client = instructor.from_openai(openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0))
    assert client.mode == instructor.Mode.TOOLS
    for model in (Invoice, Order):
        parsed = client.chat.completions.create(model=MODEL, response_model=model, max_tokens=200, max_retries=0,
                                                messages=[{"role": "user", "content": "Extract it."}], **FINISHING[model.__name__])
        assert isinstance(parsed, model)


def test_pydantic_function_tool_forced_in_chat_and_responses(served):
    _, _, client = served
    tool = openai.pydantic_function_tool(Order)  # strict, $defs, closed objects
    assert "$defs" in tool["function"]["parameters"]
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Extract it."}], tools=[tool],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0)
    assert answer.choices[0].finish_reason == "tool_calls"
    Order.model_validate_json(answer.choices[0].message.tool_calls[0].function.arguments)
    function = tool["function"]
    response = client.responses.create(model=MODEL, input="Extract it.", tools=[{"type": "function", **function}],
                                       tool_choice={"type": "function", "name": function["name"]}, parallel_tool_calls=False,
                                       max_output_tokens=200, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "Order"
    Order.model_validate_json(calls[0].arguments)


def test_a_parameters_schema_that_cannot_be_used_is_named_without_the_grammar(served):
    _, running, _ = served
    broken = {"type": "object", "properties": {"total": {"$ref": "#/$defs/Missing"}}, "required": ["total"]}
    fine = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "fine", "parameters": fine}},
             {"type": "function", "function": {"name": "broken", "parameters": broken}}]
    answer = _post(running, "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "tools": tools, "tool_choice": "required"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "tools[1].function.parameters" and "'broken'" in error["message"], error
    assert "Missing" in error["message"]
    for internal in ("<tool_call>", "%json", "start:", "x-guidance", "arguments_"):
        assert internal not in error["message"], error
    flat = [{"type": "function", **tool["function"]} for tool in tools]
    answer = _post(running, "responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4, "tools": flat,
                                          "tool_choice": {"type": "function", "name": "broken"}})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "tools[1].parameters" and "<tool_call>" not in error["message"], error
    # the format a forced turn sets aside is still checked, and named
    answer = _post(running, "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "tools": tools[:1], "tool_choice": "required", "response_format": {
                                                      "type": "json_schema", "json_schema": {"name": "b", "schema": broken}}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "response_format", answer.text


def test_a_responses_error_quotes_the_tool_choice_the_client_sent():
    """The Responses API answers through the chat path, whose errors quote the chat-shaped tool_choice
    ({'type': 'function', 'function': {'name': ...}}): they are given back in the client's own shape."""
    chat_choice = {"type": "function", "function": {"name": "get_weather"}}
    sent = {"type": "function", "name": "get_weather"}
    err = APIError(400, f"tool_choice {chat_choice!r} forces a tool call, which response_format would contradict",
                   param="response_format", code="invalid_value")
    renamed = _renamed(err, chat_choice, sent)
    assert renamed.message == f"tool_choice {sent!r} forces a tool call, which text.format would contradict"
    assert renamed.param == "text.format"
    named = _renamed(APIError(400, "tools[2].function.parameters ('f') cannot be used: x", param="tools[2].function.parameters"))
    assert (named.param, named.message) == ("tools[2].parameters", "tools[2].parameters ('f') cannot be used: x")


# -- items 2 and 3: include, and a forced call with a format ----------------------------------------------


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    sky: str = pydantic.Field(max_length=8)


WEATHER_TOOL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                "additionalProperties": False}


def test_a_forced_call_with_a_format_calls_and_the_format_shapes_the_text_turn(served):
    """OpenAI accepts both: the forced call's grammar decides that turn; the format applies to the turn
    that answers in text. vLLM's guided_* extras constrain the very answer, so they stay a 400."""
    _, running, client = served
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_TOOL}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": Weather.model_json_schema(), "strict": True}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, response_format=fmt, max_tokens=100, temperature=0)
    call = answer.choices[0].message.tool_calls[0]
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    text = client.chat.completions.create(model=MODEL, tools=tools, response_format=fmt, max_tokens=100, temperature=0, messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    Weather.model_validate_json(text.choices[0].message.content)
    refused = _post(running, "chat/completions", {"model": MODEL, "messages": messages, "tools": tools, "tool_choice": "required",
                                                  "guided_json": WEATHER_TOOL, "max_tokens": 4})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "guided_json", refused.text
    # the Responses API: the agents SDK's first turn, as it sends it (include: [], tool_choice "required", text.format)
    body = {"model": MODEL, "include": [], "input": [{"content": "Weather in Paris?", "role": "user"}],
            "instructions": "Use the tool, then answer.", "max_output_tokens": 100,
            "text": {"format": {"type": "json_schema", "name": "final_output", "strict": True,
                                "schema": {**Weather.model_json_schema(), "additionalProperties": False}}},
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
            "tools": [{"name": "get_weather", "parameters": WEATHER_TOOL, "strict": True, "type": "function",
                       "description": "The weather in a city."}]}
    response = _post(running, "responses", body)
    assert response.status_code == 200, response.text
    assert [item["type"] for item in response.json()["output"]] == ["function_call"]


def test_include_empty_or_null_asks_for_nothing_and_what_is_asked_is_refused_by_name(served):
    _, running, client = served
    for include in ([], None):
        answer = _post(running, "responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, "include": include})
        assert answer.status_code == 200, answer.text
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2, include=[]).status in ("completed", "incomplete")
    for asked in (["reasoning.encrypted_content"], ["message.output_text.logprobs", "file_search_call.results"]):
        answer = _post(running, "responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, "include": asked})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "include" and error["code"] == "unsupported_parameter" and asked[0] in error["message"], error


def test_agents_sdk_agent_with_a_function_tool_and_an_output_type_runs_and_streams(served):
    import agents  # openai-agents, in the test extra
    _, running, _ = served
    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=12)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny"

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=running.v1, api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="weather", instructions="Use the tool, then answer.", tools=[get_weather], output_type=Weather,
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=100, temperature=0))
        ran = await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        kinds = [event.data.type if event.type == "raw_response_event" else event.type async for event in streamed.stream_events()]
        await client.close()
        return [ran.final_output, streamed.final_output, kinds]

    ran, streamed, kinds = asyncio.run(main())
    assert isinstance(ran, Weather) and streamed == ran  # greedy: the same answer both ways
    assert len(cities) == 2 and cities[0] == cities[1]  # one forced call each, then the typed answer
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" in kinds
    assert kinds.count("response.completed") == 2


# -- item 4: strict closes the objects that leave additionalProperties out --------------------------------


class Price(pydantic.BaseModel):
    amount: int = pydantic.Field(ge=0, le=999)
    currency: str = pydantic.Field(max_length=3)


class Invoice2(pydantic.BaseModel):  # litellm's case: pydantic's schema, strings and numbers bounded for the tiny model
    customer: str = pydantic.Field(max_length=6)
    total: Price
    tags: list[Annotated[str, pydantic.Field(max_length=4)]] = pydantic.Field(max_length=2)


def test_strict_closes_objects_in_the_grammar(served):
    """Under strict, a key outside the schema is refused where the schema (and its $defs) leave
    additionalProperties out; without strict the same key is allowed, as written."""
    engine, _, _ = served
    schema = Invoice.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False and closed["$defs"]["Money"]["additionalProperties"] is False
    assert closed["properties"] == schema["properties"]  # only the keyword is added

    def accepts(spec_schema: dict, text: str) -> bool:
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        return engine.grammars.matcher(StructuredOutputParams(json=spec_schema)).validate_tokens(ids) == len(ids)

    good = '{"customer":"a","total":{"amount":1,"currency":"E"}}'
    for extra in ('{"customer":"a","total":{"amount":1,"currency":"E"},"zz":1}',
                  '{"customer":"a","total":{"amount":1,"currency":"E","zz":1}}'):
        assert accepts(schema, extra) and not accepts(closed, extra)
    assert accepts(closed, good)
    # an allOf of several objects keeps its branches open (each would refuse the others' keys)
    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                      {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert accepts(closed_objects(both), '{"a":1,"b":2}')


def test_a_strict_schema_without_additional_properties_answers_only_its_keys(served):
    """The exact response_format litellm sends for a dict json_schema built from model_json_schema() with
    strict (no additionalProperties anywhere), through the openai SDK and through a strict tool."""
    _, _, client = served
    schema = Invoice2.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "Invoice2", "schema": schema, "strict": True}}
    closed = closed_objects(schema)
    for seed in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Extract it."}],
                                                response_format=fmt, max_tokens=80, temperature=1.0, seed=seed)
        assert answer.choices[0].finish_reason == "stop", answer.choices[0]
        jsonschema.validate(json.loads(answer.choices[0].message.content), closed)
    tools = [{"type": "function", "function": {"name": "invoice", "parameters": schema, "strict": True}}]
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Extract it."}], tools=tools,
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=150, temperature=0)
    assert answer.choices[0].finish_reason == "tool_calls", answer.choices[0]
    jsonschema.validate(json.loads(answer.choices[0].message.tool_calls[0].function.arguments), closed)


def test_litellm_with_a_strict_pydantic_schema(served):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price list: no fetch at import
    import litellm  # in the test extra
    _, running, _ = served
    kwargs = dict(model=f"openai/{MODEL}", api_base=running.v1, api_key="unused", max_tokens=80, temperature=0,
                  messages=[{"role": "user", "content": "Extract it."}])
    answer = litellm.completion(response_format=Invoice2, **kwargs)  # litellm closes the objects itself
    Invoice2.model_validate_json(answer.choices[0].message.content)
    # as litellm users send it: pydantic's schema in a strict json_schema, no additionalProperties
    fmt = {"type": "json_schema", "json_schema": {"name": "Invoice2", "schema": Invoice2.model_json_schema(), "strict": True}}
    answer = litellm.completion(response_format=fmt, **kwargs)
    jsonschema.validate(json.loads(answer.choices[0].message.content), closed_objects(Invoice2.model_json_schema()))
