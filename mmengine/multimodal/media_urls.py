"""Image and video URLs, as OpenAI content parts carry them -> what the engine reads (encoded bytes or a
checked file path), and OpenAI's `input_audio` parts (base64 data with its format) -> encoded bytes.
The server and MMEngine.chat load them through this one module, under one policy:

- `data:image/...;base64,...` (`data:video/...` for videos): decoded from base64; the engine decodes
  the picture or the clip itself;
- `file:///path`: only under `allowed_local_media_path` (after resolving symlinks);
- `http(s)://`: only when `allow_remote_media` (capped at max_bytes, 16 times that for a video).

A bad URL is a MediaURLError naming the image or video by its position in the request.
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mmengine.errors import InvalidInputError
from mmengine.multimodal.image_loading import MAX_ENCODED_FILE_BYTES


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: Path | None = None  # resolved directory, or None: no local files
    allow_remote_media: bool = False
    remote_timeout_s: float = 10.0
    max_bytes: int = MAX_ENCODED_FILE_BYTES

    def limit(self, kind: str) -> int:
        return self.max_bytes * (16 if kind == "video" else 1)


class MediaURLError(InvalidInputError):
    """An image or video URL cannot be loaded; `code` says why in OpenAI's terms (invalid_image_url,
    remote_media_disabled, local_media_forbidden, image_too_large, ...)."""

    def __init__(self, reason: str, code: str = "invalid_image_url", prompt_index: int | None = None) -> None:
        self.code = code
        super().__init__(reason, prompt_index)

    def __reduce__(self):
        return (self.__class__, (self.reason, self.code, self.prompt_index))


def part_url(part: dict) -> str | None:
    """The URL of an OpenAI `image_url` / `video_url` content part ({"image_url": {"url": ...}}, or the
    bare string some clients send), None when it has none."""
    value = part.get(part.get("type"))
    url = value.get("url") if isinstance(value, dict) else value
    return url if isinstance(url, str) and url else None


# Containers an input_audio part may name (PyAV reads the data whatever it says; the name is checked).
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm")


def input_audio_of(part: dict) -> tuple[str, str] | None:
    """(base64 data, format) of an OpenAI `input_audio` content part ({"input_audio": {"data", "format"}}),
    None when it has neither a data string nor a format string."""
    value = part.get("input_audio")
    if not isinstance(value, dict) or not isinstance(value.get("data"), str) or not isinstance(value.get("format"), str):
        return None
    return value["data"], value["format"]


def decode_input_audio(data: str, audio_format: str, index: int, policy: MediaPolicy) -> bytes:
    """An input_audio part's base64 data as encoded bytes, its size and format checked."""
    if audio_format.lower() not in AUDIO_FORMATS:
        raise media_error(index, f"input_audio format {audio_format!r:.40} is not supported; expected one of "
                          f"{', '.join(AUDIO_FORMATS)}", "invalid_input_audio", "audio")
    limit = policy.limit("audio")
    if len(data) * 3 // 4 > limit:
        raise media_error(index, f"the audio is larger than {limit} bytes", "audio_too_large", "audio")
    try:
        decoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise media_error(index, f"input_audio data is not valid base64 ({err})", "invalid_input_audio", "audio") from None
    if not decoded:
        raise media_error(index, "input_audio data is empty", "invalid_input_audio", "audio")
    return decoded


def media_error(index: int, reason: str, code: str = "invalid_image_url", kind: str = "image") -> MediaURLError:
    return MediaURLError(f"{kind} {index}: {reason}", code.replace("image", kind))


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def load_media_url(url: str, index: int, policy: MediaPolicy, kind: str = "image", fetch: bool = False) -> bytes | str:
    """A URL as encoded bytes or a checked path. `fetch`: download an http(s) URL here (when the policy
    allows it); the server downloads them itself, asynchronously. `kind`: "image" or "video"."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _decode_data_url(url, index, policy.limit(kind), kind)
    if scheme == "file":
        return _checked_local_path(url, index, policy, kind)
    if scheme in ("http", "https"):
        if not policy.allow_remote_media:
            raise media_error(index, f"http(s) {kind} URLs are not fetched; send the {kind} as a data: URL, or allow "
                              "remote media (--allow-remote-media)", "remote_media_disabled", kind)
        if fetch:
            return _fetch(url, index, policy, kind)
    shown = url if len(url) <= 60 else url[:57] + "..."
    example = "base64 PNG, JPEG or WebP" if kind == "image" else "base64 MP4, WebM or MKV"
    raise media_error(index, f"unsupported {kind} URL {shown!r}: expected a data: URL ({example}) or a file:// URL", kind=kind)


def _decode_data_url(url: str, index: int, max_bytes: int, kind: str = "image") -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise media_error(index, "a data: URL needs a ',' before its payload", kind=kind)
    media_type, *params = header[len("data:"):].split(";")
    if media_type and not media_type.lower().startswith(f"{kind}/"):
        raise media_error(index, f"a data: URL of type {media_type!r} is not a{'n' if kind == 'image' else ''} {kind}", kind=kind)
    if "base64" not in (p.lower() for p in params):
        example = "image/png" if kind == "image" else "video/mp4"
        raise media_error(index, f"only base64 data: URLs are supported (data:{example};base64,...)", kind=kind)
    if len(payload) * 3 // 4 > max_bytes:
        raise media_error(index, f"the {kind} is larger than {max_bytes} bytes", "image_too_large", kind)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise media_error(index, f"the data: URL is not valid base64 ({err})", kind=kind) from None


def _checked_local_path(url: str, index: int, policy: MediaPolicy, kind: str = "image") -> str:
    if policy.allowed_local_media_path is None:
        raise media_error(index, f"file:// {kind} URLs are not allowed; allow a directory (--allowed-local-media-path DIR)",
                          "local_media_disabled", kind)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise media_error(index, f"a file:// URL must name a local path, got host {parts.netloc!r}", kind=kind)
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(policy.allowed_local_media_path):
        raise media_error(index, f"{path} is outside the allowed local media directory", "local_media_forbidden", kind)
    if not path.is_file():
        raise media_error(index, f"no such file: {path}", kind=kind)
    return os.fspath(path)


def _fetch(url: str, index: int, policy: MediaPolicy, kind: str) -> bytes:
    """Downloads an http(s) URL (the policy allows it), capped at the policy's size for its kind."""
    limit = policy.limit(kind)
    try:
        with urllib.request.urlopen(url, timeout=policy.remote_timeout_s) as response:  # noqa: S310 - http(s) only, checked above
            data = response.read(limit + 1)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise media_error(index, f"cannot fetch {url}: {type(err).__name__}: {err}", "remote_media_failed", kind) from None
    if len(data) > limit:
        raise media_error(index, f"the {kind} at {url} is larger than {limit} bytes", "image_too_large", kind)
    return data
