"""What the image processor's resize will allocate, known before it runs.

A tiny picture can be a bomb: a 90-byte 1x5000 PNG passes any pixel limit, and a shortest-edge
resize to 336 turns it into 336x1,680,000. So every image is checked against the size the
processor's own resize rule gives it (transformers' helpers, the same ones its resize calls) and
against an aspect-ratio limit, and refused with ImageTooLargeError naming that size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from transformers.image_transforms import get_resize_output_image_size, get_size_with_aspect_ratio
from transformers.image_utils import ChannelDimension, get_image_size_for_max_height_width

from mmengine.errors import ImageTooLargeError

# Wider than any panorama a vision-language model is shown (Qwen2-VL's processor refuses beyond 200:1 too).
MAX_IMAGE_ASPECT_RATIO = 200


def resized_size(image_processor: Any, height: int, width: int) -> tuple[int, int]:
    """(height, width) that the processor's resize makes of an image this size, by its own rule."""
    if not getattr(image_processor, "do_resize", True):
        return height, width
    size = image_processor.size
    get = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
    shortest, longest = get("shortest_edge"), get("longest_edge")
    if shortest and longest:
        return tuple(get_size_with_aspect_ratio((height, width), shortest, longest))
    if shortest:
        shape_only = np.broadcast_to(np.zeros((), np.uint8), (3, height, width))  # no pixels allocated
        return tuple(
            get_resize_output_image_size(shape_only, size=shortest, default_to_square=False, input_data_format=ChannelDimension.FIRST)
        )
    if get("max_height") and get("max_width"):
        return tuple(get_image_size_for_max_height_width((height, width), get("max_height"), get("max_width")))
    if get("height") and get("width"):
        return get("height"), get("width")
    return height, width  # an unknown rule: at least the image itself is bounded by max_image_pixels


def check_preprocessed_size(
    image_processor: Any,
    width: int,
    height: int,
    max_pixels: int,
    image_index: int,
    family_rule: Callable[[int, int], tuple[int, int] | None] | None = None,
) -> None:
    """Raises ImageTooLargeError, naming the size the image would become, if the resize would exceed
    `max_pixels` or the image's aspect ratio is beyond MAX_IMAGE_ASPECT_RATIO. `family_rule` is the
    model family's own resize rule, where it has one (else the processor's `size` settings apply)."""
    new_size = family_rule(height, width) if family_rule is not None else None
    new_height, new_width = new_size if new_size is not None else resized_size(image_processor, height, width)
    becomes = f"the processor would resize this {width}x{height} image to {new_width}x{new_height}"
    ratio = max(width, height) / max(min(width, height), 1)
    if ratio > MAX_IMAGE_ASPECT_RATIO:
        raise ImageTooLargeError(
            f"image {image_index}: aspect ratio {ratio:.0f}:1 exceeds {MAX_IMAGE_ASPECT_RATIO}:1 ({becomes})"
        )
    if new_width * new_height > max_pixels:
        raise ImageTooLargeError(
            f"image {image_index}: {becomes} = {new_width * new_height} pixels, more than max_image_pixels={max_pixels}"
        )
