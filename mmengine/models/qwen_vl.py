"""Qwen2-VL and Qwen2.5-VL: native-resolution images, a variable number of tokens per image, M-RoPE.

An image is resized (transformers' `smart_resize`) to multiples of patch_size * merge_size pixels
between min_pixels and max_pixels, cut into patch_size patches (two frames each, for the temporal
patch), and each merge_size x merge_size group of patches becomes one embedding. The vision tower is
transformers' own module: it takes every patch of a step as one sequence with per-image boundaries
(and in 2.5, windowed attention in all but the full-attention layers), and its patch merger gives the
embeddings in image order, so a step's items run as one batch and are split back by token count. Its
attention runs through `layers/packed_vision_attention`: one SDPA call per distinct image or window
length in a layer, where transformers' SDPA path makes one per image or window.

The model (qwen_vl_model.py) is that tower over the Qwen2 text model with M-RoPE: every token has a
(temporal, height, width) position; text tokens advance all three together, an image's tokens take its grid
coordinates, and generated tokens continue at `index + delta` (transformers' `get_rope_index`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from mmengine.core.request import MMItem
from mmengine.errors import UnsupportedModelError
from mmengine.models import qwen_video
from mmengine.models.family import EncoderInputs, ModelClass, ModelFamily, PromptPositions, VideoPlan
from mmengine.models.qwen_resize import max_tokens_for_pixels, smart_resize
from mmengine.multimodal.resize_guard import MAX_IMAGE_ASPECT_RATIO

# transformers' Qwen2-VL image processor defaults, for settings a checkpoint leaves out.
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280


class Qwen2VLFamily(ModelFamily):
    architectures = ("Qwen2VLForConditionalGeneration",)
    model_type = "qwen2_vl"
    display_name = "Qwen2-VL (native resolution, M-RoPE)"
    model_class = ModelClass("mmengine.models.qwen_vl_model", "QwenVLModel")
    position_channels = 3
    embeds_need_grid = True

    def __init__(
        self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None, model_dir: str | None = None
    ) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        vision = hf_config.vision_config
        settings = self.image_processor_settings
        self.patch_size = int(settings.get("patch_size") or vision.patch_size)
        self.merge_size = int(settings.get("merge_size") or vision.spatial_merge_size)
        self.temporal_patch_size = int(settings.get("temporal_patch_size") or vision.temporal_patch_size)
        self.min_pixels, self.max_pixels = pixel_bounds(settings)
        if self.merge_size != vision.spatial_merge_size or self.patch_size != vision.patch_size:
            raise UnsupportedModelError(
                f"the image processor's patch_size {self.patch_size} / merge_size {self.merge_size} differ from the "
                f"vision tower's {vision.patch_size} / {vision.spatial_merge_size}"
            )
        self.video = qwen_video.load_video_settings(
            model_dir, self.model_type, vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size
        )
        if (self.video.patch_size, self.video.merge_size) != (vision.patch_size, vision.spatial_merge_size):
            raise UnsupportedModelError(
                f"the video processor's patch_size {self.video.patch_size} / merge_size {self.video.merge_size} differ "
                f"from the vision tower's {vision.patch_size} / {vision.spatial_merge_size}"
            )

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """transformers' processor class for the family, built from the tokenizer and the PIL-backend
        image processor (on every machine, as `ModelFamily.load_processor` says why), without its
        torchvision-only video processor: the engine patches videos itself (`qwen_video.py`), so the
        processor is the same class with the same parts whether or not torchvision is installed."""
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # (explicitly the PIL class: AutoImageProcessor itself asks for torchvision in some transformers 5 releases)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **overrides)
        processor_class = cls.processor_class()
        # the chat template AutoProcessor would take (chat_template.jinja / .json, else the tokenizer's)
        saved, _ = processor_class.get_processor_dict(model_dir, local_files_only=True)
        return image_only_processor_class(processor_class)(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=saved.get("chat_template") or tokenizer.chat_template
        )

    # Whether the family's processor class names the tokens around a video marker (Qwen3-VL's do)
    processor_names_vision_wrap: bool = False
    full_processor_reason = ""

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """The parts load_processor builds its processor from, and the tokens its processor class names."""
        from mmengine.multimodal.light_processor import (
            LightProcessor, checkpoint_text_parts, special_token, unpickled_without_modeling_code,
        )

        tokenizer, saved = checkpoint_text_parts(model_dir)
        from transformers import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **overrides)
        wrap = ((special_token(tokenizer, "vision_start_token", "<|vision_start|>"),
                 special_token(tokenizer, "vision_end_token", "<|vision_end|>")) if cls.processor_names_vision_wrap else ("", ""))
        return LightProcessor(
            tokenizer, unpickled_without_modeling_code(image_processor),
            saved.get("chat_template") or tokenizer.chat_template,
            special_token(tokenizer, "image_token", "<|image_pad|>"), special_token(tokenizer, "video_token", "<|video_pad|>"),
            *wrap,
        )

    @classmethod
    def processor_class(cls) -> type:
        from transformers import Qwen2VLProcessor

        return Qwen2VLProcessor

    @property
    def factor(self) -> int:
        """Resized images are multiples of this many pixels on each side; each such square is one embedding."""
        return self.patch_size * self.merge_size

    def max_tokens_per_image(self) -> int:
        return max_tokens_for_pixels(self.min_pixels, self.max_pixels, self.factor)

    def max_tokens_by_modality(self) -> dict[str, int]:
        """An image, and a video's temporal patch (each is one item)."""
        return {"image": self.max_tokens_per_image(), "video": qwen_video.max_tokens_per_patch(self.video)}

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        f = self.factor
        video = self.video
        bounds = "all frames together" if video.whole_clip_bounds else "each frame"
        modalities = self.max_tokens_by_modality()
        shut = sorted(m for m in modalities if limits is not None and limits.get(m, 0) == 0)
        unused = f" ({', '.join(shut)} not allowed by limit_mm_per_prompt: not counted)" if 0 < len(shut) < len(modalities) else ""
        return (
            f"images resized to multiples of {f}x{f} px (patch {self.patch_size} x merge {self.merge_size}), "
            f"one embedding each, within min_pixels {self.min_pixels} / max_pixels {self.max_pixels}: "
            f"at most {self.max_tokens_per_image()} for any aspect ratio up to {MAX_IMAGE_ASPECT_RATIO}:1; "
            f"videos: one item per {video.temporal_patch_size} frames, within min_pixels {video.min_pixels} / "
            f"max_pixels {video.max_pixels} for {bounds}: at most {qwen_video.max_tokens_per_patch(video)} per item{unused}"
        )

    # -- videos -------------------------------------------------------------------

    @property
    def video_token_id(self) -> int | None:
        return self.hf_config.video_token_id

    @property
    def max_items_per_video(self) -> int:
        return -(-self.video.max_frames // self.video.temporal_patch_size)

    def plan_video(self, info: Any, video: Any, keep_all_frames: bool = False) -> VideoPlan:
        rules = self.video
        if keep_all_frames:
            indices = list(range(info.num_frames))
        else:
            indices = qwen_video.sample_indices(
                rules, self.model_type in qwen_video.QWEN3_VIDEO_FAMILIES, info.num_frames, info.fps, video.fps, video.num_frames
            )
        height, width = qwen_video.resized_size(
            rules, len(indices), info.height, info.width, video.min_pixels, video.max_pixels, video.total_pixels
        )
        num_patches = -(-len(indices) // rules.temporal_patch_size)
        sampled_fps = len(indices) / info.num_frames * info.fps
        return VideoPlan(
            indices=tuple(indices),
            source_fps=info.fps,
            source_frames=info.num_frames,
            height=height,
            width=width,
            num_patches=num_patches,
            tokens_per_patch=(height // self.factor) * (width // self.factor),
            time_step=self.video_time_step(sampled_fps),
            timestamps=tuple(_patch_timestamps(indices, info.fps, rules.temporal_patch_size)),
        )

    def video_time_step(self, sampled_fps: float) -> float:
        """M-RoPE temporal positions between a video's patches: one for Qwen2-VL."""
        return 1.0

    def video_items(self, frames: np.ndarray, plan: VideoPlan) -> list[EncoderInputs]:
        return [EncoderInputs(item) for item in qwen_video.patch_items(self.video, frames, plan.height, plan.width)]

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        grids = batch["image_grid_thw"]
        if grids.shape[0] != num_images:
            raise UnsupportedModelError(f"the image processor returned {grids.shape[0]} grids for {num_images} images")
        chunks = torch.split(batch["pixel_values"], grids.prod(-1).tolist())
        if num_images == 1:  # its own tensor already: no copy
            return [EncoderInputs(pixel_values=chunks[0], image_grid_thw=grids.view(1, 3).clone())]
        return [EncoderInputs(pixel_values=chunk.clone(), image_grid_thw=grid.view(1, 3).clone()) for grid, chunk in zip(grids, chunks)]

    def num_tokens(self, inputs: EncoderInputs) -> int:
        return int(inputs["image_grid_thw"].prod()) // self.merge_size**2

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        """Items of the largest token count: one row of merge-size squares (as many patches as any image)."""
        m = self.merge_size
        grid = torch.tensor([[1, m, m * self.max_tokens_per_item()]])
        patch_dim = 3 * self.temporal_patch_size * self.patch_size**2
        pixels = torch.zeros(int(grid.prod()), patch_dim)
        return [EncoderInputs(pixel_values=pixels, image_grid_thw=grid) for _ in range(num_items)]

    def prompt_positions(self, token_ids: Sequence[int], items: Sequence[MMItem]) -> PromptPositions | None:
        """A video's items (its temporal patches, adjacent in the prompt) take one run of grid (patches,
        h, w), as transformers positions the whole video."""
        if not items:
            return None  # every channel equals the token index: plain positions
        runs: list[tuple[int, int]] = []
        grids: list[tuple[int, int, int]] = []
        steps: list[float] = []
        for item in items:
            t, h, w = (int(x) for x in item.encoder_inputs["image_grid_thw"].view(3).tolist())
            patch = item.video_patch
            if patch is not None and patch.index > 0 and self.video_runs_join:
                offset, length = runs[-1]
                runs[-1] = (offset, length + item.length)
                grids[-1] = (grids[-1][0] + t, h, w)
                continue
            runs.append((item.offset, item.length))
            grids.append((t, h, w))
            steps.append(patch.time_step if patch is not None else 1.0)
        return mrope_positions(len(token_ids), runs, grids, self.merge_size, steps)

    # Whether a video's patches form one position run (Qwen2-VL, Qwen2.5-VL) or are each their own,
    # between timestamps (Qwen3-VL)
    video_runs_join = True


class Qwen2_5_VLFamily(Qwen2VLFamily):
    """Qwen2.5-VL: Qwen2-VL's recipe with a windowed-attention vision tower (transformers' module), and
    video patches spaced in time by tokens_per_second."""

    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    model_type = "qwen2_5_vl"
    display_name = "Qwen2.5-VL (native resolution, windowed vision attention, M-RoPE)"

    def video_time_step(self, sampled_fps: float) -> float:
        """tokens_per_second x seconds per temporal patch (transformers' second_per_grid_ts)."""
        return self.hf_config.vision_config.tokens_per_second * self.video.temporal_patch_size / sampled_fps

    @classmethod
    def processor_class(cls) -> type:
        from transformers import Qwen2_5_VLProcessor

        return Qwen2_5_VLProcessor


def image_only_processor_class(processor_class: type) -> type:
    """`processor_class` without its video processor: transformers reads a processor's parts from its
    __init__ signature, so leaving video_processor out of it skips the torchvision-only part."""

    class ImageOnly(processor_class):  # type: ignore[misc,valid-type]
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"{processor_class.__name__}ImageOnly"
    return ImageOnly


def pixel_bounds(settings: dict[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels) from image-processor settings: the `size` dict its resize reads
    (transformers 5: shortest_edge / longest_edge), else older checkpoints' min_pixels / max_pixels."""
    size = settings.get("size") or {}
    size = size if isinstance(size, dict) else {}
    min_pixels = size.get("shortest_edge") or size.get("min_pixels") or settings.get("min_pixels") or _DEFAULT_MIN_PIXELS
    max_pixels = size.get("longest_edge") or size.get("max_pixels") or settings.get("max_pixels") or _DEFAULT_MAX_PIXELS
    return int(min_pixels), int(max_pixels)


def mrope_positions(
    num_tokens: int,
    runs: Sequence[tuple[int, int]],
    grids: Sequence[tuple[int, int, int]],
    merge_size: int,
    time_steps: Sequence[float] | None = None,
) -> PromptPositions:
    """transformers' `get_rope_index` for one prompt: text advances all channels by one per token; an
    image or video run of grid (t, h, w) patches takes (floor(t x time step), h / merge, w / merge)
    coordinates offset by the current position, which then moves on by max(h, w) / merge (transformers
    5 does not move past a video's temporal extent)."""
    table = np.empty((num_tokens, 3), dtype=np.int64)
    current = 0
    previous_end = 0
    steps = time_steps if time_steps is not None else [1.0] * len(runs)
    for (offset, length), (t, h, w), step in zip(runs, grids, steps):
        num_text = offset - previous_end
        table[previous_end:offset] = (np.arange(num_text) + current)[:, None]
        current += num_text
        grid_h, grid_w = h // merge_size, w // merge_size
        if t * grid_h * grid_w != length:
            raise UnsupportedModelError(f"an image run of {length} tokens does not match its grid {t}x{h}x{w}")
        temporal = (torch.arange(t) * step).long().numpy()  # as transformers quantizes it
        tt, hh, ww = np.meshgrid(temporal, np.arange(grid_h), np.arange(grid_w), indexing="ij")
        table[offset : offset + length] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()], axis=1) + current
        current += max(grid_h, grid_w)
        previous_end = offset + length
    table[previous_end:] = (np.arange(num_tokens - previous_end) + current)[:, None]
    delta = int(table.max()) + 1 - num_tokens if num_tokens else 0
    return PromptPositions(table, delta)


def _patch_timestamps(indices: Sequence[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds at the middle of each temporal patch (its first and last frames averaged, the last patch
    padded with its last frame), as Qwen3-VL's processor writes them."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / fps for i in padded]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]

