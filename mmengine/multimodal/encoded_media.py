"""Encoded audio and video as a caller gives them: a path's or bytes' content, read within a size but not
decoded, how errors show a path, and the duration an opened container states."""

from __future__ import annotations

import os
from typing import Any

from mmengine.errors import InvalidInputError

_SHOWN = 200


def read_encoded(
    source: object, where: str, what: str, *, max_file_bytes: int, too_large: type[InvalidInputError],
    corrupt: type[InvalidInputError], max_given_bytes: int | None = None, name_file: bool = False,
) -> bytes | None:
    """A path's or bytes' content (read, not decoded); None for any other source. A file over
    `max_file_bytes`, or given bytes over `max_given_bytes`, is `too_large`; a file that cannot be read,
    or empty data, is `corrupt`. Messages start with `where`, and show the path where `name_file` (else
    `where` names it already)."""
    if isinstance(source, (str, os.PathLike)):
        file = shown_path(source) if name_file else "the file"
        try:  # (ValueError: e.g. a NUL in the path; the typed errors are ValueErrors too, so none is raised here)
            with open(source, "rb") as opened:
                fits = os.fstat(opened.fileno()).st_size <= max_file_bytes
                data = opened.read() if fits else b""
        except (OSError, ValueError) as exc:
            raise corrupt(f"{where}: cannot read {file}: {exc}") from exc
        if not fits:
            raise too_large(f"{where}: {file} is larger than {max_file_bytes} bytes")
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if max_given_bytes is not None and len(data) > max_given_bytes:
            raise too_large(f"{where}: the {what} bytes are larger than {max_given_bytes} bytes")
    else:
        return None
    if not data:
        raise corrupt(f"{where}: the {what} bytes are empty")
    return data


def shown_path(path: str | os.PathLike) -> str:
    """The path for error messages, shortened (a str may well be a mistaken base64 blob)."""
    text = os.fspath(path)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def stated_seconds(container: Any, stream: Any) -> float:
    """The duration an opened PyAV container states for `stream` (0.0 where it states none)."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000
    return 0.0
