"""The request fields that constrain an answer, as OpenAI and vLLM clients send them, turned into one
StructuredOutputParams: `response_format` (json_object, json_schema with `strict`) and vLLM's extras
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark) and `guided_whitespace_pattern`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmengine.entrypoints.api_errors import APIError
from mmengine.errors import ConfigError
from mmengine.sample.structured_output import StructuredOutputParams

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # The schema is always enforced in full (an unsupported keyword is a 400, never skipped), so
    # strict=false changes nothing: it is accepted, not ignored.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def structured_output_of(body: Any) -> tuple[StructuredOutputParams | None, str | None]:
    """The spec the body asks for and the field that asked (None, None when unconstrained)."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt: ResponseFormat | None = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format.json_schema",
                           code="invalid_value")
        asked.append(("response_format", {"json": fmt.json_schema.schema_}))
    for name, kind in zip(GUIDED_FIELDS, ("json", "regex", "choice", "grammar")):
        value = getattr(body, name, None)
        if value is not None:
            asked.append((name, {kind: value}))
    whitespace = getattr(body, "guided_whitespace_pattern", None)
    if not asked:
        if whitespace is not None:
            raise APIError(400, "guided_whitespace_pattern needs a JSON response_format or guided_json",
                           param="guided_whitespace_pattern", code="invalid_value")
        return None, None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(400, f"one way of constraining the answer at a time: got {names}", param=asked[1][0], code="invalid_value")
    field, spec = asked[0]
    if whitespace is not None:
        spec["whitespace_pattern"] = whitespace
    try:
        return StructuredOutputParams(**spec), field
    except ConfigError as err:
        raise APIError(400, str(err).replace("SamplingParams.structured_output", field), param=field, code="invalid_value") from None
