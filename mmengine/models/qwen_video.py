"""Qwen's video recipe (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), as transformers' video processors apply it:
which frames are sampled, the size frames are resized to, normalization and patching, and what each
temporal patch puts into the prompt.

transformers' video processors need torchvision; these are the same rules on PIL and numpy (frames
are resized with PIL's bicubic filter, as the PIL image processor resizes images). A video of
`temporal_patch_size` copies of one frame is the image path's input for that frame, patch for patch.

The vision towers attend within a temporal patch only (their attention windows and position grids
repeat per patch), so each temporal patch is encoded as its own item of grid (1, h, w): a long clip is
encoded in parts across steps and every part is cached under its own hash.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmengine.errors import InvalidInputError
from mmengine.models.qwen_resize import max_tokens_for_pixels, smart_resize

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class QwenVideoSettings:
    """A checkpoint's video processor settings (its video_preprocessor_config.json over transformers'
    class defaults). `whole_clip_bounds`: min/max pixels bound all frames together (Qwen3-VL), not each."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    fps: float
    min_frames: int
    max_frames: int
    whole_clip_bounds: bool
    # Qwen2-VL's optional qwen-vl-utils cap: each frame limited to an even share of this many tokens' pixels
    max_video_tokens: int
    cap_pixels_per_frame: bool

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


# Families that sample and bound videos as Qwen3-VL's video processor does (over the clip, 32-px units).
QWEN3_VIDEO_FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def load_video_settings(model_dir: str | Path | None, family: str, patch_size: int, temporal_patch_size: int, merge_size: int) -> QwenVideoSettings:
    """The settings of transformers' Qwen2VLVideoProcessor / Qwen3VLVideoProcessor, read from the
    checkpoint's video_preprocessor_config.json where it has one."""
    qwen3 = family in QWEN3_VIDEO_FAMILIES
    saved: dict[str, Any] = {}
    path = Path(model_dir) / VIDEO_PROCESSOR_FILE if model_dir is not None else None
    if path is not None and path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
    size = saved.get("size") or {}
    unit = 32 if qwen3 else 28
    min_pixels = saved.get("min_pixels") or size.get("shortest_edge") or 128 * unit * unit
    max_pixels = saved.get("max_pixels") or size.get("longest_edge") or 768 * unit * unit
    default_mean, default_std = ((0.5,) * 3, (0.5,) * 3) if qwen3 else (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    return QwenVideoSettings(
        patch_size=int(saved.get("patch_size") or patch_size),
        temporal_patch_size=int(saved.get("temporal_patch_size") or temporal_patch_size),
        merge_size=int(saved.get("merge_size") or merge_size),
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
        image_mean=tuple(float(x) for x in saved.get("image_mean") or default_mean),
        image_std=tuple(float(x) for x in saved.get("image_std") or default_std),
        fps=float(saved.get("fps") or 2.0),
        min_frames=int(saved.get("min_frames") or 4),
        max_frames=int(saved.get("max_frames") or 768),
        whole_clip_bounds=qwen3,
        max_video_tokens=int(saved.get("max_video_tokens") or (768 if qwen3 else 128000)),
        cap_pixels_per_frame=bool(saved.get("cap_pixels_per_frame") or False),
    )


def sample_indices(settings: QwenVideoSettings, qwen3: bool, total: int, source_fps: float, fps: float | None, num_frames: int | None) -> list[int]:
    """Indices of the frames to keep, by transformers' `sample_frames` of the family's video processor."""
    t = settings.temporal_patch_size
    if num_frames is not None and num_frames > settings.max_frames:
        raise InvalidInputError(f"num_frames={num_frames} exceeds the video processor's max_frames={settings.max_frames}")
    if qwen3:
        if num_frames is None:
            num_frames = int(total / source_fps * (fps if fps is not None else settings.fps))
            num_frames = min(max(num_frames, settings.min_frames), settings.max_frames, total)
        return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()  # (more than total repeats frames)
    if num_frames is not None:
        num_frames = round(num_frames / t) * t
    else:
        most = math.floor(min(settings.max_frames, total) / t) * t
        wanted = total / source_fps * (fps if fps is not None else settings.fps)
        num_frames = math.floor(min(max(wanted, settings.min_frames), most, total) / t) * t
    if num_frames < 1:
        raise InvalidInputError(f"sampling keeps no frame of this {total}-frame video (it needs {t} frames at least)")
    if num_frames > total:
        raise InvalidInputError(f"num_frames={num_frames} exceeds the video's {total} frames")
    return torch.arange(0, total, total / num_frames).int().tolist()


def resized_size(
    settings: QwenVideoSettings, num_frames: int, height: int, width: int,
    min_pixels: int | None = None, max_pixels: int | None = None, total_pixels: int | None = None,
) -> tuple[int, int]:
    """(height, width) every frame is resized to: transformers' video smart_resize for the family, with
    a request's bounds in place of the checkpoint's. Qwen2-VL bounds each frame (and, with total_pixels
    or cap_pixels_per_frame, limits each frame to its share of a total); Qwen3-VL bounds the whole clip."""
    factor, temporal = settings.factor, settings.temporal_patch_size
    low = min_pixels or settings.min_pixels
    high = max_pixels or settings.max_pixels
    ratio = max(height, width) / max(min(height, width), 1)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidInputError(f"aspect ratio {ratio:.0f}:1 exceeds {MAX_ASPECT_RATIO}:1")
    if settings.whole_clip_bounds:
        if total_pixels is not None:
            high = total_pixels
        elif settings.cap_pixels_per_frame:
            per_frame = max(min(settings.max_video_tokens * factor * factor, high // num_frames), int(low * 1.05))
            high = per_frame * num_frames
        num_frames = max(num_frames, temporal)  # a shorter clip is padded to one temporal patch
        if height < factor or width < factor:  # Qwen3-VL scales a thin clip up to one factor first
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        return smart_resize(height, width, factor, low, high, num_frames, temporal)
    total = total_pixels or (int(settings.max_video_tokens * factor * factor * 0.9) if settings.cap_pixels_per_frame else None)
    if total is not None:
        high = max(min(high, total * temporal // num_frames), int(low * 1.05))
    return smart_resize(height, width, factor, low, high)


def patch_items(settings: QwenVideoSettings, frames: np.ndarray, height: int, width: int) -> list[dict[str, torch.Tensor]]:
    """Frames [T, H, W, 3] uint8 resized, rescaled, normalized and patched as transformers' video
    processor patches them, split into one item per temporal patch: {"pixel_values": [h*w patches,
    3 * temporal * patch**2], "image_grid_thw": [[1, h, w]]} (the last patch padded with the last frame)."""
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    std = np.asarray(settings.image_std, dtype=np.float32)[:, None, None]
    mean = np.asarray(settings.image_mean, dtype=np.float32)[:, None, None]
    resized = _resized(frames, height, width)
    if pad := -len(resized) % t:
        resized = np.concatenate([resized, np.repeat(resized[-1:], pad, axis=0)])
    # rescale and normalize in one pass: x / 255 / std - mean / std (transformers fuses them too)
    clip = resized.transpose(0, 3, 1, 2).astype(np.float32) * (1 / (255 * std)) - mean / std  # [T, 3, H, W]
    grid_t, grid_h, grid_w = len(clip) // t, height // p, width // p
    patches = clip.reshape(grid_t, t, 3, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(grid_t, grid_h * grid_w, 3 * t * p * p)
    grid = torch.tensor([[1, grid_h, grid_w]])
    return [{"pixel_values": torch.from_numpy(np.ascontiguousarray(chunk)), "image_grid_thw": grid.clone()} for chunk in patches]


def _resized(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """Every frame resized with PIL's bicubic filter (which releases the GIL: a long clip is resized on
    a few threads)."""
    if frames.shape[1:3] == (height, width):
        return frames

    def resize(frame: np.ndarray) -> np.ndarray:
        return np.asarray(Image.fromarray(frame).resize((width, height), resample=Image.BICUBIC))

    if len(frames) < 8:
        return np.stack([resize(frame) for frame in frames])
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return np.stack(list(pool.map(resize, frames)))


def max_tokens_per_patch(settings: QwenVideoSettings) -> int:
    """An upper bound on one temporal patch's embeddings under the checkpoint's bounds (Qwen3-VL's
    bound holds for at least one full temporal patch of frames)."""
    high = settings.max_pixels // settings.temporal_patch_size if settings.whole_clip_bounds else settings.max_pixels
    low = settings.min_pixels // settings.temporal_patch_size if settings.whole_clip_bounds else settings.min_pixels
    return max_tokens_for_pixels(low, max(high, 1), settings.factor)
