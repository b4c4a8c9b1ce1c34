"""What a request's output must match: exactly one of a JSON schema, any JSON object, a regex, a
choice of strings or a Lark grammar. Plain data; grammar.py turns it into a matcher."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mmengine.errors import ConfigError

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _bad(reason: str) -> ConfigError:
    return ConfigError(f"SamplingParams.structured_output {reason}")


@dataclass(frozen=True)
class StructuredOutputParams:
    """Set exactly one of:

    json          a JSON schema (a dict, or its JSON text); the output is one JSON value it accepts
    json_object   True: the output is any JSON object (OpenAI's response_format json_object)
    regex         the output matches this regular expression (Rust regex syntax, anchored at both ends)
    choice        the output is exactly one of these strings
    grammar       a Lark grammar (llguidance's dialect); `start` is its top rule

    JSON is compact (no whitespace between tokens) unless `whitespace_pattern` gives the regex of the
    whitespace allowed there; a free-whitespace grammar lets a model emit newlines until max_tokens.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    _key: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise _bad(f"needs exactly one of {', '.join(_KINDS)}; got {given or 'none'}")
        if not isinstance(self.json_object, bool):
            raise _bad(f"json_object must be a bool, got {self.json_object!r}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as err:
                    raise _bad(f"json is not valid JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise _bad(f"json must be a JSON schema (an object), got {type(schema).__name__}")
            object.__setattr__(self, "json", schema)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or (not value and name != "whitespace_pattern")):
                raise _bad(f"{name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise _bad(f"choice must be a non-empty list of strs, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise _bad(f"choice must hold non-empty strs, got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise _bad("whitespace_pattern applies to json and json_object only")
        spec = {kind: getattr(self, kind) for kind in (*_KINDS, "whitespace_pattern")}
        object.__setattr__(self, "_key", json.dumps(spec, sort_keys=True))

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    @property
    def cache_key(self) -> str:
        """Equal specs compile to the same grammar: the compile cache's key."""
        return self._key

    def __hash__(self) -> int:
        return hash(self._key)
