"""OpenAI-style media parts in MMEngine.chat, as vLLM's LLM.chat takes them: `image_url` and `video_url`
parts become the `{"type": "image"}` / `{"type": "video"}` parts a chat template writes, and their URLs
are loaded by the server's loader under the same policy (multimodal/media_urls.py): data: URLs always,
file:// under an allowed directory, http(s) only when allowed."""

from __future__ import annotations

from typing import Any

from mmengine.errors import InvalidInputError
from mmengine.multimodal.media_urls import MediaPolicy, load_media_url, part_url

URL_PARTS = {"image_url": "image", "video_url": "video"}


def has_media_parts(conversation: list[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") in URL_PARTS for p in m["content"])
               for m in conversation)


def take_media_parts(conversation: list[dict[str, Any]], policy: MediaPolicy,
                     prompt_index: int) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """(the conversation with placeholder parts, its pictures in order, its videos in order)."""
    images: list[Any] = []
    videos: list[Any] = []
    rendered = []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            kind = URL_PARTS.get(part.get("type"))
            if kind is None:
                parts.append(part)
                continue
            found = videos if kind == "video" else images
            try:
                found.append(load_media_url(part_url(part), len(found), policy, kind, fetch=True))
            except InvalidInputError as err:
                raise err.at_prompt(prompt_index) from err
            parts.append({"type": kind})
        rendered.append({**message, "content": parts})
    return rendered, images, videos
