"""Command-line flags for the engine's options: one per EngineConfig option, generated from the option
groups' dataclasses (config.py), shared by `mmengine serve`, `demo` and `generate`. Imports no torch, so
--help stays fast."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Collection
from typing import Any

from mmengine.config import EngineConfig


def add_engine_options(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    """One flag per EngineConfig option (but `exclude`, names a command uses otherwise); a flag left out
    keeps the option's default."""
    group = parser.add_argument_group("engine options (EngineConfig's option groups; see mmengine/config.py)")
    for owner, field in EngineConfig.option_fields():
        if field.name in exclude:
            continue
        hints = typing.get_type_hints(owner)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        kind = _base_type(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        shown = f"default: {_shown(default)}"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, dest=field.name, help=shown)
        elif kind in (int, float, str):
            group.add_argument(flag, type=kind, default=None, dest=field.name, metavar=kind.__name__.upper(), help=shown)
        elif typing.get_origin(kind) is dict:
            value_type = typing.get_args(kind)[1]
            group.add_argument(flag, type=mapping_parser(flag, value_type), default=None, dest=field.name,
                               metavar="KEY=VALUE[,KEY=VALUE]", help=shown)
        else:
            raise TypeError(f"{owner.__name__}.{field.name}: no command-line form for {hints[field.name]!r}")


def engine_options(args: argparse.Namespace, exclude: Collection[str] = ()) -> dict[str, Any]:
    """The EngineConfig options given on the command line (add_engine_options' flags)."""
    return {
        field.name: getattr(args, field.name)
        for _, field in EngineConfig.option_fields()
        if field.name not in exclude and getattr(args, field.name) is not None
    }


def _base_type(hint: Any) -> Any:
    """`int | None` -> int; other hints as they are."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _shown(value: object) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return "none" if value is None else str(value)


def mapping_parser(flag: str, value_type: Any) -> typing.Callable[[str], dict[str, Any]]:
    """KEY=VALUE[,KEY=VALUE] or a JSON object (vLLM's form: '{"image": 2, "video": 0}'). Values of type Any
    (speculative_config's) keep their JSON types; in the KEY=VALUE form a value that reads as JSON (a number)
    is taken as such, else as a string."""
    expected = f"{flag} expects KEY=VALUE[,KEY=VALUE] or a JSON object"
    if value_type is Any:
        value_type = _json_scalar

    def parse(text: str) -> dict[str, Any]:
        if text.lstrip().startswith("{"):
            return _json_mapping(text, value_type, expected)
        mapping = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            try:
                if not (sep and key.strip()):
                    raise ValueError
                mapping[key.strip()] = value_type(value.strip())
            except ValueError:
                raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        return mapping

    return parse


def _json_scalar(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _json_mapping(text: str, value_type: Any, expected: str) -> dict[str, Any]:
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r} ({err.msg})") from None
    if not isinstance(mapping, dict):
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
    if value_type is _json_scalar:
        return mapping
    for key, value in mapping.items():
        if isinstance(value, bool) or not isinstance(value, value_type if value_type is not float else (int, float)):
            raise argparse.ArgumentTypeError(f"{expected}: {key!r} must be a {value_type.__name__}, got {value!r}")
    return {key: value_type(value) for key, value in mapping.items()}
