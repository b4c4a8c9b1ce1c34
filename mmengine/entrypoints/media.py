"""Image URLs of OpenAI messages -> what the engine reads (encoded bytes or a file path).

- `data:image/...;base64,...`: decoded from base64 here; the engine decodes the image itself.
- `file:///path`: only under `--allowed-local-media-path DIR` (after resolving symlinks).
- `http(s)://`: refused unless fetching is enabled (`--allow-remote-media`); no network is assumed.

Bad URLs raise APIError (400, param "messages") naming the image by its position in the request.
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


def _bad(index: int, reason: str, code: str = "invalid_image_url") -> APIError:
    return APIError(400, f"image {index}: {reason}", param="messages", code=code)


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def load_local_image_url(url: str, index: int, policy: MediaPolicy) -> bytes | str:
    """A data: or file: URL as encoded bytes or a checked path. Runs base64 decoding, so call it off
    the event loop for large uploads."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _decode_data_url(url, index, policy.max_bytes)
    if scheme == "file":
        return _checked_local_path(url, index, policy)
    if scheme in ("http", "https"):
        raise _bad(index, "http(s) image URLs are not fetched by this server; send the image as a "
                   "data: URL, or start the server with --allow-remote-media", code="remote_media_disabled")
    shown = url if len(url) <= 60 else url[:57] + "..."
    raise _bad(index, f"unsupported image URL {shown!r}: expected a data: URL (base64 PNG, JPEG or WebP) or a file:// URL")


def _decode_data_url(url: str, index: int, max_bytes: int) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise _bad(index, "a data: URL needs a ',' before its payload")
    media_type, *params = header[len("data:"):].split(";")
    if media_type and not media_type.lower().startswith("image/"):
        raise _bad(index, f"a data: URL of type {media_type!r} is not an image")
    if "base64" not in (p.lower() for p in params):
        raise _bad(index, "only base64 data: URLs are supported (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > max_bytes:
        raise _bad(index, f"the image is larger than {max_bytes} bytes", code="image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise _bad(index, f"the data: URL is not valid base64 ({err})") from None


def _checked_local_path(url: str, index: int, policy: MediaPolicy) -> str:
    if policy.allowed_local_media_path is None:
        raise _bad(index, "file:// image URLs are not allowed; start the server with --allowed-local-media-path DIR",
                   code="local_media_disabled")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _bad(index, f"a file:// URL must name a local path, got host {parts.netloc!r}")
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(policy.allowed_local_media_path):
        raise _bad(index, f"{path} is outside the allowed local media directory", code="local_media_forbidden")
    if not path.is_file():
        raise _bad(index, f"no such file: {path}")
    return os.fspath(path)


async def fetch_remote_image(url: str, index: int, policy: MediaPolicy) -> bytes:
    """Downloads an http(s) image (only when the policy allows it), capped at policy.max_bytes."""
    if not policy.allow_remote_media:
        return load_local_image_url(url, index, policy)  # raises the refusal
    import httpx

    try:
        async with httpx.AsyncClient(timeout=policy.remote_timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise _bad(index, f"fetching {url} answered HTTP {response.status_code}", code="remote_media_failed")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > policy.max_bytes:
                        raise _bad(index, f"the image at {url} is larger than {policy.max_bytes} bytes", code="image_too_large")
                return bytes(data)
    except httpx.HTTPError as err:
        raise _bad(index, f"cannot fetch {url}: {type(err).__name__}: {err}", code="remote_media_failed") from None
