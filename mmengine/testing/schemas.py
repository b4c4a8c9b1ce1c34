"""JSON schemas of varied shape (what users pull out of pictures: receipts, forms, screenshots), for
the structured-output tests and benchmarks."""

from __future__ import annotations

from typing import Any

# Every string, number and array is bounded, so that a random-weight model's answer ends well within
# a test's max_tokens (an unbounded string lets it write until the limit).
_MONEY = {"type": "integer", "minimum": 0, "maximum": 99999}  # cents
_NUMBER = {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.5}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_strings": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20}, "author": {"type": "string", "maxLength": 20}},
                     "required": ["title", "author"], "additionalProperties": False},
    "receipt": {"type": "object", "properties": {
        "store": {"type": "string", "maxLength": 24},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "price": _MONEY},
            "required": ["name", "price"], "additionalProperties": False}},
        "total": _MONEY}, "required": ["store", "items", "total"], "additionalProperties": False},
    "enum_colour": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                    "required": ["colour"], "additionalProperties": False},
    "integer_range": {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99}},
                      "required": ["count"], "additionalProperties": False},
    "boolean_answer": {"type": "object", "properties": {"has_person": {"type": "boolean"}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
                       "required": ["has_person"], "additionalProperties": False},
    "string_array": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
    "nested_address": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 16},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "date_pattern": {"type": "object", "properties": {"date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}},
                     "required": ["date"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -50, "maximum": 50}, "b": {"type": "string", "maxLength": 8},
                                                         "c": {"type": "boolean"}},
                        "required": ["a"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "string", "maxLength": 8}]}},
               "required": ["value"], "additionalProperties": False},
    "const_kind": {"type": "object", "properties": {"kind": {"const": "invoice"}, "number": {"type": "integer", "minimum": 1, "maximum": 9999}},
                   "required": ["kind", "number"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 8}},
                 "required": ["note"], "additionalProperties": False},
    "bounding_boxes": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 4, "maxItems": 4}},
    "labelled_objects": {"type": "object", "properties": {"objects": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"label": {"enum": ["cat", "dog", "car", "tree"]},
                                         "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["label", "count"], "additionalProperties": False}}},
        "required": ["objects"], "additionalProperties": False},
    "number_array": {"type": "array", "items": _NUMBER, "maxItems": 5},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 640}, "y": {"type": "integer", "minimum": 0, "maximum": 480}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"], "additionalProperties": False},
    "form_fields": {"type": "object", "properties": {
        "first_name": {"type": "string", "maxLength": 10}, "last_name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 130}, "email": {"type": "string", "maxLength": 20},
        "subscribed": {"type": "boolean"}},
        "required": ["first_name", "last_name", "age", "email", "subscribed"], "additionalProperties": False},
    "top_level_enum": {"enum": ["yes", "no", "unsure"]},
    "screenshot_ui": {"type": "object", "properties": {"buttons": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 10}, "enabled": {"type": "boolean"}},
        "required": ["text", "enabled"], "additionalProperties": False}}, "title": {"type": "string", "maxLength": 12}},
        "required": ["buttons", "title"], "additionalProperties": False},
    "one_of_shapes": {"oneOf": [
        {"type": "object", "properties": {"circle": _NUMBER}, "required": ["circle"],
         "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["square"],
         "additionalProperties": False}]},
}
