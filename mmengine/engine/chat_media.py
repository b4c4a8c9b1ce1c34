"""OpenAI-style media parts in MMEngine.chat, as vLLM's LLM.chat takes them: `image_url`, `video_url` and
`input_audio` parts become the `{"type": "image"}` / `{"type": "video"}` / `{"type": "audio"}` parts a
chat template writes. URLs are loaded by the server's loader under the same policy
(multimodal/media_urls.py): data: URLs always, file:// under an allowed directory, http(s) only when
allowed; an input_audio part's base64 data is decoded (its size checked)."""

from __future__ import annotations

from typing import Any

from mmengine.errors import InvalidInputError
from mmengine.multimodal.media_urls import MediaPolicy, decode_input_audio, input_audio_of, load_media_url, part_url

URL_PARTS = {"image_url": "image", "video_url": "video"}
MEDIA_PARTS = (*URL_PARTS, "input_audio")


def has_media_parts(conversation: list[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") in MEDIA_PARTS for p in m["content"])
               for m in conversation)


def take_media_parts(conversation: list[dict[str, Any]], policy: MediaPolicy,
                     prompt_index: int) -> tuple[list[dict[str, Any]], list[Any], list[Any], list[Any]]:
    """(the conversation with placeholder parts, its pictures, its videos and its audio clips, each in order)."""
    found: dict[str, list[Any]] = {"image": [], "video": [], "audio": []}
    rendered = []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            kind = "audio" if part.get("type") == "input_audio" else URL_PARTS.get(part.get("type"))
            if kind is None:
                parts.append(part)
                continue
            media = found[kind]
            try:
                if kind == "audio":
                    media.append(decode_input_audio(*input_audio_of(part), len(media), policy))
                else:
                    media.append(load_media_url(part_url(part), len(media), policy, kind, fetch=True))
            except InvalidInputError as err:
                raise err.at_prompt(prompt_index) from err
            parts.append({"type": kind})
        rendered.append({**message, "content": parts})
    return rendered, found["image"], found["video"], found["audio"]
