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
    **params: object,
) -> Request:
    """A request whose prompt is tokens 1..n, with image items at (offset, length)."""
    items = [MMItem("image", off, length, {"pixel_values": torch.zeros(1)}) for off, length in images]
    processed = ProcessedPrompt(None, list(range(1, num_prompt_tokens + 1)), items)
    return Request(request_id, processed, SamplingParams(max_tokens=max_tokens, **params), arrival)
