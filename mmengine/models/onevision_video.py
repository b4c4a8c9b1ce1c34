"""LLaVA-OneVision's video recipe, as transformers' LlavaOnevisionVideoProcessor applies it (that processor
needs torchvision; these are its rules on PIL and numpy): which frames are kept, each frame resized to the
tower's square with PIL's bicubic filter (as the PIL image processors resize), rescaled and normalized.

Every frame is one item of ceil(side / 2)^2 embeddings (its patch features bilinearly pooled 2x, in the
model); the last item also carries the newline embedding that ends the video's run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmengine.errors import InvalidInputError, UnsupportedModelError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"


@dataclass(frozen=True)
class OnevisionVideoSettings:
    """The checkpoint's video processor settings (its video_preprocessor_config.json over transformers'
    class defaults): the frame size, normalization, and the sampling a request does not override."""

    height: int
    width: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    do_sample_frames: bool
    num_frames: int | None
    fps: float | None


def load_video_settings(model_dir: str | Path | None, tile: int) -> OnevisionVideoSettings:
    saved: dict[str, Any] = {}
    path = Path(model_dir) / VIDEO_PROCESSOR_FILE if model_dir is not None else None
    if path is not None and path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
    size = saved.get("size") or {"height": tile, "width": tile}
    if not size.get("height") or not size.get("width"):
        raise UnsupportedModelError(f"{VIDEO_PROCESSOR_FILE}: size {size} is not supported (expected height and width)")
    if saved.get("do_center_crop") or saved.get("do_resize") is False or saved.get("do_normalize") is False or \
            saved.get("do_rescale") is False:
        raise UnsupportedModelError(f"{VIDEO_PROCESSOR_FILE}: only resize, rescale and normalize are supported")
    return OnevisionVideoSettings(
        height=int(size["height"]),
        width=int(size["width"]),
        image_mean=tuple(float(x) for x in saved.get("image_mean") or OPENAI_CLIP_MEAN),
        image_std=tuple(float(x) for x in saved.get("image_std") or OPENAI_CLIP_STD),
        rescale_factor=float(saved.get("rescale_factor") or 1 / 255),
        do_sample_frames=bool(saved.get("do_sample_frames") or False),
        num_frames=saved.get("num_frames"),
        fps=saved.get("fps"),
    )


def sample_indices(settings: OnevisionVideoSettings, total: int, source_fps: float, fps: float | None,
                   num_frames: int | None, keep_all: bool) -> list[int]:
    """transformers' default_sample_indices_fn: the request's fps or num_frames, else the checkpoint's when it
    samples frames, else every frame (the processor's do_sample_frames=False)."""
    if keep_all:
        return list(range(total))
    if fps is None and num_frames is None and settings.do_sample_frames:
        fps, num_frames = settings.fps, settings.num_frames
    if num_frames is None and fps is not None:
        num_frames = max(1, int(total / source_fps * fps))
    if num_frames is None:
        return list(range(total))
    if num_frames > total:
        raise InvalidInputError(f"sampling {num_frames} frames exceeds the video's {total} frames")
    return (np.arange(num_frames, dtype=int) * total // num_frames).tolist()


def frame_pixels(settings: OnevisionVideoSettings, frames: np.ndarray) -> torch.Tensor:
    """Frames [T, H, W, 3] uint8 as the tower's inputs [T, 3, height, width] float32."""
    size = (settings.width, settings.height)
    resized = np.stack([frame if frame.shape[:2] == size[::-1] else
                        np.asarray(Image.fromarray(frame).resize(size, resample=Image.BICUBIC)) for frame in frames])
    std = np.asarray(settings.image_std, dtype=np.float32)[:, None, None]
    mean = np.asarray(settings.image_mean, dtype=np.float32)[:, None, None]
    clip = (resized.transpose(0, 3, 1, 2).astype(np.float32) * np.float32(settings.rescale_factor) - mean) / std
    return torch.from_numpy(np.ascontiguousarray(clip))
