"""Image and video URLs and input_audio data of OpenAI messages, for the server: the shared loader
(multimodal/media_urls.py) with its errors as 400s (param "messages"), and http(s) downloads on the
event loop (httpx)."""

from __future__ import annotations

from mmengine.entrypoints.api_errors import APIError
from mmengine.multimodal.media_urls import (
    MediaPolicy,
    MediaURLError,
    decode_input_audio,
    is_remote,
    load_media_url,
    media_error,
)

__all__ = ["MediaPolicy", "fetch_remote_image", "is_remote", "load_input_audio", "load_local_image_url"]


def _api_error(err: MediaURLError) -> APIError:
    return APIError(400, err.reason, param="messages", code=err.code)


def load_local_image_url(url: str, index: int, policy: MediaPolicy, kind: str = "image") -> bytes | str:
    """A data: or file: URL as encoded bytes or a checked path. Runs base64 decoding, so call it off
    the event loop for large uploads. `kind`: "image" or "video", what the URL must hold."""
    try:
        return load_media_url(url, index, policy, kind)
    except MediaURLError as err:
        raise _api_error(err) from None


def load_input_audio(data: str, audio_format: str, index: int, policy: MediaPolicy) -> bytes:
    """An input_audio part's base64 data as encoded bytes (run it off the event loop: it decodes base64)."""
    try:
        return decode_input_audio(data, audio_format, index, policy)
    except MediaURLError as err:
        raise _api_error(err) from None


async def fetch_remote_image(url: str, index: int, policy: MediaPolicy, kind: str = "image") -> bytes:
    """Downloads an http(s) image or video (only when the policy allows it), capped at the policy's size."""
    if not policy.allow_remote_media:
        return load_local_image_url(url, index, policy, kind)  # raises the refusal
    max_bytes = policy.limit(kind)
    import httpx

    try:
        async with httpx.AsyncClient(timeout=policy.remote_timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise _api_error(media_error(index, f"fetching {url} answered HTTP {response.status_code}",
                                                 "remote_media_failed", kind))
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > max_bytes:
                        raise _api_error(media_error(index, f"the {kind} at {url} is larger than {max_bytes} bytes",
                                                     "image_too_large", kind))
                return bytes(data)
    except httpx.HTTPError as err:
        raise _api_error(media_error(index, f"cannot fetch {url}: {type(err).__name__}: {err}", "remote_media_failed",
                                     kind)) from None
