"""Tool calling in the chat template's format: Qwen's (Hermes style) `<tool_call>` JSON blocks.

The request's `tools` go to the chat template (which must render them: a template that ignores them
is a 400, not a silent drop); `tool_choice` "auto" lets the model decide, "none" leaves the tools out,
and "required" or a named function are enforced by the grammar engine: the answer is one or more
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks whose arguments match the
function's parameters schema (compact JSON; each schema a root document of its own, so its `$defs` and
`$ref`s resolve; a `strict` function's objects closed). Calls in the answer become OpenAI `tool_calls`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mmengine.entrypoints.api_errors import APIError
from mmengine.entrypoints.response_format import closed_objects
from mmengine.sample.structured_output import StructuredOutputParams
from mmengine.utils.ids import random_hex

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls enforce the parameters in full; strict also closes their objects


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def forced_function(tools: list[Tool] | None, tool_choice: Any) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function); a 400 for a choice that does not fit."""
    names = [tool.function.name for tool in tools or ()]
    if len(set(names)) != len(names):
        raise _bad("tools must have distinct function names", "tools")
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not names:
            raise _bad(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise _bad(f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(names) or 'none'})",
                       "tool_choice")
        return "named", name
    raise _bad(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, "
               f"got {tool_choice!r:.80}", "tool_choice")


_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False}  # compact JSON, as StructuredOutputParams(json=...)


def parameters_schema(tool: Tool) -> dict[str, Any]:
    """The schema a call's arguments must match: the function's parameters (any object when left out),
    with its objects closed when the function is `strict` (as response_format's strict closes them)."""
    function = tool.function
    parameters = function.parameters if function.parameters is not None else {"type": "object"}
    return closed_objects(parameters) if function.strict else parameters


def parameter_specs(tools: list[Tool], only: str | None = None) -> list[tuple[int, str, StructuredOutputParams]]:
    """(index in tools, name, the arguments' spec) of each function a forced call may call: each
    schema on its own, so a schema llguidance refuses is named by its function."""
    return [(index, tool.function.name, StructuredOutputParams(json=parameters_schema(tool)))
            for index, tool in enumerate(tools) if only is None or tool.function.name == only]


def call_grammar(tools: list[Tool], only: str | None = None, single: bool = False) -> StructuredOutputParams:
    """A grammar for one or more calls (one when `single`; of `only`, when named), each the compact
    JSON `{"name":NAME,"arguments":ARGUMENTS}` whose arguments match the function's parameters schema.

    Each parameters schema is a `%json` document of its own (the root of its own references), not a
    branch of one wrapping schema: `$defs` / `$ref` (pydantic's nested models, `List[Model]`) resolve
    as they do in response_format."""
    repeat = "" if single else ' ("\\n" call)*'
    lines = [f"start: call{repeat}", f"call: {json.dumps(CALL_OPEN + chr(10))} body {json.dumps(chr(10) + CALL_CLOSE)}"]
    rules = []
    for number, (_, name, spec) in enumerate(parameter_specs(tools, only)):
        head = json.dumps('{"name":' + json.dumps(name) + ',"arguments":')
        lines.append(f"call_{number}: {head} arguments_{number} {json.dumps('}')}")
        lines.append(f"arguments_{number}: %json {json.dumps({**spec.json, 'x-guidance': _JSON_OPTIONS})}")
        rules.append(f"call_{number}")
    lines.insert(2, "body: " + " | ".join(rules))
    return StructuredOutputParams(grammar="\n".join(lines))


@dataclass
class ParsedAnswer:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _call(body: str) -> dict[str, Any] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return {"id": f"call_{random_hex(24)}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> ParsedAnswer:
    """The calls in a whole answer and the text around them (None when only calls). A block that is
    not a JSON call stays in the content, as the model wrote it."""
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return ParsedAnswer(content if content or not calls else None, calls)


class ToolCallStream:
    """Splits a streamed answer into content deltas and whole tool calls: text before a `<tool_call>`
    streams as content; a call is sent once its closing tag arrives."""

    def __init__(self) -> None:
        self._pending = ""  # text that may be (the start of) a call
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, calls completed now)."""
        self._pending += text
        content, calls = [], []
        while True:
            start = self._pending.find(CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_tag(self._pending)
                content.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            content.append(self._pending[:start])
            self._pending = self._pending[start:]
            end = self._pending.find(CALL_CLOSE)
            if end < 0:
                if final:  # an unfinished call is text, as in the whole answer
                    content.append(self._pending)
                    self._pending = ""
                break
            block = self._pending[: end + len(CALL_CLOSE)]
            self._pending = self._pending[end + len(CALL_CLOSE):]
            call = _call(block[len(CALL_OPEN): -len(CALL_CLOSE)].strip())
            if call is None:
                content.append(block)
            else:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
        return "".join(content), calls


def _partial_tag(text: str) -> int:
    """How many trailing characters of `text` could begin `<tool_call>`."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


def template_renders_tools(template_text: str | None) -> bool:
    return bool(template_text) and "tools" in template_text
