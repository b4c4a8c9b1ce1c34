"""Qwen's resize rule for images and video clips, and the largest item it can make: shared by the
image family (qwen_vl.py) and its video rules (qwen_video.py)."""

from __future__ import annotations

import math

from mmengine.multimodal.resize_guard import MAX_IMAGE_ASPECT_RATIO


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, num_frames: int = 1, temporal_factor: int = 1
) -> tuple[int, int]:
    """transformers' Qwen resize rule: sides multiples of `factor`, area within [min, max] pixels. For
    Qwen3-VL's videos the bounds hold for all `num_frames` frames together (rounded to a multiple of
    `temporal_factor`); one frame is the image rule."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def max_tokens_for_pixels(min_pixels: int, max_pixels: int, factor: int, max_aspect: int = MAX_IMAGE_ASPECT_RATIO) -> int:
    """An upper bound, attained or nearly, on the embeddings of any image `smart_resize` can produce with
    an aspect ratio up to `max_aspect`. Three regimes:
    - both sides at least `factor` after scaling: the area stays within max_pixels;
    - a very long, thin image: the short side is clamped up to `factor`, the long side is at most
      sqrt(max_pixels * max_aspect);
    - an upscaled small image: rounding up adds at most one unit per side to min_pixels' area."""
    units = factor * factor
    within_area = max_pixels // units
    thin = int(math.sqrt(max_pixels * max_aspect) // factor)
    side = math.sqrt(min_pixels) / factor
    stretch = math.sqrt(max_aspect) + 1 / math.sqrt(max_aspect)
    upscaled = math.ceil(min_pixels / units + side * stretch + 1)
    return max(within_area, thin, upscaled, 1)
