"""Image and video URLs of OpenAI messages -> what the engine reads (encoded bytes or a file path).

- `data:image/...;base64,...` (`data:video/...` for videos): decoded from base64 here; the engine
  decodes the picture or the clip itself.
- `file:///path`: only under `--allowed-local-media-path DIR` (after resolving symlinks).
- `http(s)://`: refused unless fetching is enabled (`--allow-remote-media`); no network is assumed.

Bad URLs raise APIError (400, param "messages") naming the image or video by its position in the request.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mmengine.entrypoints.api_errors import APIError
from mmengine.multimodal.image_loading import MAX_ENCODED_FILE_BYTES


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: Path | None = None  # resolved directory, or None: no local files
    allow_remote_media: bool = False
    remote_timeout_s: float = 10.0
    max_bytes: int = MAX_ENCODED_FILE_BYTES


def _bad(index: int, reason: str, code: str = "invalid_image_url", kind: str = "image") -> APIError:
    return APIError(400, f"{kind} {index}: {reason}", param="messages", code=code.replace("image", kind))


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def load_local_image_url(url: str, index: int, policy: MediaPolicy, kind: str = "image") -> bytes | str:
    """A data: or file: URL as encoded bytes or a checked path. Runs base64 decoding, so call it off
    the event loop for large uploads. `kind`: "image" or "video", what the URL must hold."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _decode_data_url(url, index, policy.max_bytes * (16 if kind == "video" else 1), kind)
    if scheme == "file":
        return _checked_local_path(url, index, policy, kind)
    if scheme in ("http", "https"):
        raise _bad(index, f"http(s) {kind} URLs are not fetched by this server; send the {kind} as a "
                   "data: URL, or start the server with --allow-remote-media", code="remote_media_disabled", kind=kind)
    shown = url if len(url) <= 60 else url[:57] + "..."
    example = "base64 PNG, JPEG or WebP" if kind == "image" else "base64 MP4, WebM or MKV"
    raise _bad(index, f"unsupported {kind} URL {shown!r}: expected a data: URL ({example}) or a file:// URL", kind=kind)


def _decode_data_url(url: str, index: int, max_bytes: int, kind: str = "image") -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise _bad(index, "a data: URL needs a ',' before its payload", kind=kind)
    media_type, *params = header[len("data:"):].split(";")
    if media_type and not media_type.lower().startswith(f"{kind}/"):
        raise _bad(index, f"a data: URL of type {media_type!r} is not a{'n' if kind == 'image' else ''} {kind}", kind=kind)
    if "base64" not in (p.lower() for p in params):
        raise _bad(index, f"only base64 data: URLs are supported (data:{'image/png' if kind == 'image' else 'video/mp4'};base64,...)", kind=kind)
    if len(payload) * 3 // 4 > max_bytes:
        raise _bad(index, f"the {kind} is larger than {max_bytes} bytes", code="image_too_large", kind=kind)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise _bad(index, f"the data: URL is not valid base64 ({err})", kind=kind) from None


def _checked_local_path(url: str, index: int, policy: MediaPolicy, kind: str = "image") -> str:
    if policy.allowed_local_media_path is None:
        raise _bad(index, f"file:// {kind} URLs are not allowed; start the server with --allowed-local-media-path DIR",
                   code="local_media_disabled", kind=kind)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _bad(index, f"a file:// URL must name a local path, got host {parts.netloc!r}", kind=kind)
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(policy.allowed_local_media_path):
        raise _bad(index, f"{path} is outside the allowed local media directory", code="local_media_forbidden", kind=kind)
    if not path.is_file():
        raise _bad(index, f"no such file: {path}", kind=kind)
    return os.fspath(path)


async def fetch_remote_image(url: str, index: int, policy: MediaPolicy, kind: str = "image") -> bytes:
    """Downloads an http(s) image or video (only when the policy allows it), capped at policy.max_bytes
    (16 times that for a video)."""
    if not policy.allow_remote_media:
        return load_local_image_url(url, index, policy, kind)  # raises the refusal
    max_bytes = policy.max_bytes * (16 if kind == "video" else 1)
    import httpx

    try:
        async with httpx.AsyncClient(timeout=policy.remote_timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise _bad(index, f"fetching {url} answered HTTP {response.status_code}", code="remote_media_failed", kind=kind)
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > max_bytes:
                        raise _bad(index, f"the {kind} at {url} is larger than {max_bytes} bytes", code="image_too_large", kind=kind)
                return bytes(data)
    except httpx.HTTPError as err:
        raise _bad(index, f"cannot fetch {url}: {type(err).__name__}: {err}", code="remote_media_failed", kind=kind) from None
