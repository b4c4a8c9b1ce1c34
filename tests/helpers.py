"""Plain builders for unit tests of the scheduler and KV cache (no model needed)."""

from __future__ import annotations

import torch

from mmengine.request import MMItem, ProcessedPrompt, Request
from mmengine.sampling import SamplingParams


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int = 4,
    images: list[tuple[int, int]] = (),
    arrival: int = 0,
    tokens: list[int] | None = None,
    image_hashes: list[str] | None = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    **params: object,
) -> Request:
    """A request whose prompt is `tokens` (default 1..n), with image items at (offset, length)."""
    hashes = image_hashes or [f"img{i}" for i in range(len(images))]
    items = [MMItem("image", h, off, length, {"pixel_values": torch.zeros(1)}) for h, (off, length) in zip(hashes, images)]
    processed = ProcessedPrompt(None, tokens if tokens is not None else list(range(1, num_prompt_tokens + 1)), items)
    return Request(
        request_id, processed, SamplingParams(max_tokens=max_tokens, **params), arrival,
        cache_salt=cache_salt, lora_name=lora_name,
    )
