"""The request fields that constrain an answer, as OpenAI and vLLM clients send them, turned into one
StructuredOutputParams: `response_format` (json_object, json_schema with `strict`) and vLLM's extras
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark) and `guided_whitespace_pattern`.

`strict: true` closes objects as vLLM does: an object schema that does not say `additionalProperties`
is read as saying false (OpenAI would answer such a schema with a 400), so a model cannot open a key
the schema does not name. Without `strict` the schema is enforced as written (open objects stay open)."""

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
    # The schema is always enforced in full (an unsupported keyword is a 400, never skipped); strict=true
    # also closes the objects that leave additionalProperties out (closed_objects).
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
        schema = fmt.json_schema.schema_
        asked.append(("response_format", {"json": closed_objects(schema) if fmt.json_schema.strict else schema}))
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


# keywords whose value is one schema, a list of schemas, or a map of names to schemas
_ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties", "contains",
               "propertyNames", "not", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that says neither `additionalProperties` nor
    `unevaluatedProperties` says `additionalProperties: false` (strict mode, as vLLM reads it), at every
    depth: properties, items, anyOf / oneOf branches, $defs. Two exceptions, where closing would refuse
    what the schema allows: the branches of an `allOf` of several schemas (each would refuse the others'
    keys) and a schema that has an `allOf` of its own stay as written (their nested objects are closed)."""
    return _closed(schema, in_all_of=False)


def _closed(node: Any, in_all_of: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _ONE_SCHEMA:
            out[key] = [_closed(v, False) for v in value] if isinstance(value, list) else _closed(value, False)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_closed(v, False) for v in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_closed(v, len(value) > 1) for v in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _closed(v, False) for name, v in value.items()}
        else:  # const, enum, default, examples, ...: data, not schemas
            out[key] = value
    kind = node.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (kind is None and "properties" in node)
    if (is_object and not in_all_of and "allOf" not in node and "additionalProperties" not in node
            and "unevaluatedProperties" not in node):
        out["additionalProperties"] = False
    return out
