"""`POST /v1/responses`: OpenAI's Responses API on the same engine loop as chat completions.

A Responses request is translated into the chat request it means (instructions as the system
message, input_text / input_image parts, text.format as response_format, flat function tools as
chat tools) and answered by the chat path; its answer, whole or streamed, is translated back into a
Response object or the Responses event sequence. Nothing is stored (`store: true` and
`previous_response_id` are refused by name), and every field not honoured is a 400 naming it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from mmengine.engine.prompt_inputs import type_name
from mmengine.entrypoints.api_errors import APIError
from mmengine.entrypoints.protocol import ChatCompletionRequest
from mmengine.entrypoints.responses import new_id

# chat fields as the Responses API names them, for errors raised by the chat path
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format"}


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses that this server honours; any other field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[Any]  # each item an object: checked by _messages, which names the item
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None  # extra output data: none is served, so only an empty list (or null) is accepted

    def check_supported(self) -> None:
        if self.include:
            raise _bad(f"include {self.include!r} is not supported: this server adds no extra output data (send [] or "
                       "leave it out)", "include", "unsupported_parameter")
        if self.store:
            raise _bad("store=true is not supported: this server keeps no responses (send store=false, or leave it out)",
                       "store", "unsupported_parameter")
        if self.previous_response_id is not None:
            raise _bad("previous_response_id is not supported: no responses are stored; send the whole conversation as input",
                       "previous_response_id", "unsupported_parameter")

    def chat_request(self) -> ChatCompletionRequest:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += _messages(self.input)
        fields: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
                                  "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                                  "stream": self.stream}
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        if self.text is not None:
            fields["response_format"] = _response_format(self.text)
        if self.tools:
            fields["tools"] = [_chat_tool(tool, index) for index, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        try:
            return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
        except ValueError as err:
            raise _bad(f"the request does not translate into a chat: {err}", "input", "invalid_value") from None


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages: messages with input_text / input_image / output_text
    parts, and function_call / function_call_output items as an assistant's tool calls and tool turns."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object (a message, function_call or function_call_output item), got "
                       f"{type_name(item)}", "input")
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output", "")})
        elif kind == "message":
            role = item.get("role")
            content = item.get("content")
            if isinstance(content, list):
                content = [_part(part, f"{where}.content[{i}]") for i, part in enumerate(content)]
            elif content is not None and not isinstance(content, str):
                raise _bad(f"{where}.content must be a string or a list of content parts, got {type_name(content)}", "input")
            messages.append({"role": "system" if role == "developer" else role, "content": [] if content is None else content})
        else:
            raise _bad(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output are)", "input", "unsupported_parameter")
    return messages


def _part(part: Any, where: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise _bad(f"{where} must be a content part object ({{'type': 'input_text', 'text': ...}}), got {type_name(part)}",
                   "input")
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        if part.get("detail") not in (None, "auto"):
            raise _bad(f"{where}: detail {part['detail']!r} is not supported (pictures are seen at the model's own resolution)",
                       "input", "unsupported_parameter")
        if not part.get("image_url"):
            raise _bad(f"{where}: an input_image needs an image_url (a data: URL, an allowed file:// or http(s) URL); "
                       "file_id is not supported", "input", "unsupported_parameter")
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise _bad(f"{where}: content parts of type {kind!r} are not supported (input_text, input_image, output_text are)",
               "input", "unsupported_parameter")


def _response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    unknown = sorted(set(text) - {"format"})
    if unknown:
        raise _bad(f"text.{unknown[0]} is not supported", f"text.{unknown[0]}", "unsupported_parameter")
    form = text.get("format") or {"type": "text"}
    if not isinstance(form, dict):
        raise _bad(f"text.format must be an object such as {{'type': 'json_object'}}, got {type_name(form)}", "text.format")
    kind = form.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {key: form[key] for key in ("name", "schema", "strict", "description") if key in form}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(f"text.format type {kind!r} is not supported (text, json_object, json_schema are)", "text.format")


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise _bad(f"tools[{index}]: tools of type {tool.get('type')!r} are not supported (function is)", "tools",
                   "unsupported_parameter")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad(f"tool_choice {choice!r} is not supported ('auto', 'none', 'required' or {{'type': 'function', 'name': ...}})",
               "tool_choice")


class ResponseBuilder:
    """The Response object of one request: its echo of the request, its output items and usage."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body
        self.id = new_id("resp")
        self.created_at = time.time()
        self.message_id = new_id("msg")
        self.reasoning_id = new_id("rs")

    def envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": body.model,
            "output": output, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {}, "store": False, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "usage": usage,
        }

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" or text else []}

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    @staticmethod
    def call_item(call: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    @staticmethod
    def usage(chat_usage: dict[str, Any], reasoning_tokens: int = 0) -> dict[str, Any]:
        """`reasoning_tokens`: the reasoning text's tokens (counted again by the tokenizer)."""
        details = chat_usage.get("prompt_tokens_details") or {}
        return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
                "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": chat_usage["total_tokens"]}

    def whole(self, chat: dict[str, Any], count_tokens: Callable[[str], int]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        reasoning = message.get("reasoning_content")
        output = [self.reasoning_item(reasoning)] if reasoning else []
        output += [self.message_item(message["content"])] if message.get("content") else []
        output += [self.call_item(call) for call in message.get("tool_calls") or []]
        incomplete = "max_output_tokens" if choice["finish_reason"] == "length" else None
        usage = self.usage(chat["usage"], count_tokens(reasoning) if reasoning else 0)
        return self.envelope("incomplete" if incomplete else "completed", output, usage, incomplete)


async def create_response(body: ResponsesRequest, chat: Callable[[ChatCompletionRequest], Awaitable[Response]],
                          count_tokens: Callable[[str], int]) -> Response:
    """Answers `body` through `chat` (the server's chat-completions path); `count_tokens` counts a text's tokens."""
    body.check_supported()
    builder = ResponseBuilder(body)
    request = body.chat_request()
    try:
        answer = await chat(request)
    except APIError as err:
        raise _renamed(err, request.tool_choice, body.tool_choice) from err
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(_events(builder, answer.body_iterator, count_tokens), media_type="text/event-stream",
                                 background=answer.background)
    if answer.status_code != 200:
        return answer
    return JSONResponse(builder.whole(json.loads(answer.body), count_tokens))


def _renamed(err: APIError, chat_choice: Any = None, sent_choice: Any = None) -> APIError:
    """The chat path's error as the Responses API names things: its fields, its flat tools
    (`tools[0].parameters`), and the tool_choice the client sent (not the chat-converted one)."""
    param = _PARAMS.get(err.param, err.param) if err.param else err.param
    message = err.message
    if chat_choice is not None and chat_choice != sent_choice:
        message = message.replace(repr(chat_choice), repr(sent_choice))
    for chat_name, name in _PARAMS.items():
        message = message.replace(chat_name, name)
    message = _CHAT_TOOL.sub(r"\1.", message)
    param = _CHAT_TOOL.sub(r"\1.", param) if param else param
    return APIError(err.status, message, param=param, code=err.code, headers=err.headers)


_CHAT_TOOL = re.compile(r"(tools\[\d+\])\.function\.")


async def _events(builder: ResponseBuilder, chunks: AsyncIterator[str | bytes], count_tokens: Callable[[str], int]) -> AsyncIterator[str]:
    """The chat stream's chunks as the Responses events: created, in_progress, a reasoning item (with a
    reasoning parser) and the message item with their text deltas, a function_call item per tool call,
    completed (with usage)."""
    sequence = 0
    output: list[dict[str, Any]] = []  # finished items
    open_kind: str | None = None  # the item being streamed: "reasoning" or "message"
    texts: dict[str, list[str]] = {"reasoning": [], "message": []}

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **fields})}\n\n"

    def opened(kind: str) -> list[str]:
        nonlocal open_kind
        events = close()
        open_kind = kind
        index = len(output)
        if kind == "reasoning":
            return events + [event("response.output_item.added", output_index=index, item=builder.reasoning_item("", "in_progress"))]
        return events + [event("response.output_item.added", output_index=index, item=builder.message_item("", "in_progress")),
                         event("response.content_part.added", item_id=builder.message_id, output_index=index, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})]

    def close() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        kind, open_kind, index = open_kind, None, len(output)
        whole = "".join(texts[kind])
        if kind == "reasoning":
            output.append(builder.reasoning_item(whole))
            return [event("response.reasoning_text.done", item_id=builder.reasoning_id, output_index=index, content_index=0, text=whole),
                    event("response.output_item.done", output_index=index, item=output[-1])]
        output.append(builder.message_item(whole))
        return [event("response.output_text.done", item_id=builder.message_id, output_index=index, content_index=0, text=whole,
                      logprobs=[]),
                event("response.content_part.done", item_id=builder.message_id, output_index=index, content_index=0,
                      part={"type": "output_text", "text": whole, "annotations": []}),
                event("response.output_item.done", output_index=index, item=output[-1])]

    yield event("response.created", response=builder.envelope("in_progress", []))
    yield event("response.in_progress", response=builder.envelope("in_progress", []))
    calls: dict[int, dict[str, Any]] = {}
    usage, finish = None, None
    async for raw in chunks:
        line = raw.decode() if isinstance(raw, bytes) else raw
        payload = line.removeprefix("data: ").strip()
        if not payload or payload == "[DONE]":
            continue
        chunk = json.loads(payload)
        if "error" in chunk:
            yield event("error", message=chunk["error"].get("message"), code=chunk["error"].get("code"), param=None)
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            finish = choice.get("finish_reason") or finish
            for kind, key, item_id in (("reasoning", "reasoning_content", builder.reasoning_id), ("message", "content", builder.message_id)):
                if delta.get(key):
                    for opening in (opened(kind) if open_kind != kind else []):
                        yield opening
                    texts[kind].append(delta[key])
                    name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                    extra = {} if kind == "reasoning" else {"logprobs": []}
                    yield event(name, item_id=item_id, output_index=len(output), content_index=0, delta=delta[key], **extra)
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "function": {"name": None, "arguments": ""}})
                entry["id"] = call.get("id") or entry["id"]
                entry["function"]["name"] = call.get("function", {}).get("name") or entry["function"]["name"]
                entry["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
    for closing in close():
        yield closing
    for _, call in sorted(calls.items()):
        item, index = builder.call_item(call), len(output)
        yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"],
                    name=item["name"])
        output.append(item)
        yield event("response.output_item.done", output_index=index, item=item)
    incomplete = "max_output_tokens" if finish == "length" else None
    reasoning_tokens = count_tokens("".join(texts["reasoning"])) if texts["reasoning"] else 0
    final = builder.envelope("incomplete" if incomplete else "completed", output,
                             builder.usage(usage, reasoning_tokens) if usage else None, incomplete)
    yield event("response.incomplete" if incomplete else "response.completed", response=final)
