"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): LLaVA's SigLIP tower and two-layer projector
over a Qwen2 decoder, with anyres-max tiling (models/anyres.py).

A picture becomes its tower inputs: the whole picture resized to one tile, then the tiles of the
pinpoint resolution it is resized and padded into (`image_grid_pinpoints`). All of them go through the
tower and projector; the tiles' features are laid out as one map, the padding cut off, interpolated
down to about N tiles' worth under `anyres_max_N`, and each row ends with the `image_newline` embedding.
The whole picture is one item (one encoder-cache entry, all its tiles), hashed on its pixels and the
processor settings (the pinpoints among them). Positions are plain 1-D.

transformers' processor tiles every picture of a flat image list, which is how the engine hands them
over (and how the references call it); its other mode (a nested list holding several pictures for one
prompt: each padded to a square and not tiled) is not used.

Videos (`<video>`): transformers' video processor needs torchvision, so its rules are the family's own
(models/onevision_video.py). Each kept frame, resized to the tower's square, is one item: its patch
features, projected and bilinearly pooled to ceil(side / 2)^2; the video's last item ends with the newline
embedding (VideoPlan.trailing_tokens), as transformers ends the whole video's run with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.models import onevision_video
from mmengine.models.anyres import AnyresSettings
from mmengine.models.family import EncoderInputs, ModelClass, ModelFamily, VideoPlan

SUPPORTED_VISION_MODEL_TYPES = ("siglip_vision_model",)


def check_onevision_config(config: PretrainedConfig) -> None:
    vision_type = config.vision_config.model_type
    if vision_type not in SUPPORTED_VISION_MODEL_TYPES:
        raise UnsupportedModelError(f"vision tower {vision_type!r} is not supported; supported: {', '.join(SUPPORTED_VISION_MODEL_TYPES)}")
    if config.vision_feature_select_strategy != "full":  # transformers' packing needs every patch of a tile
        raise UnsupportedModelError(f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is not supported "
                                    "(LLaVA-OneVision's tiles keep every patch: 'full')")


class LlavaOnevisionFamily(ModelFamily):
    architectures = ("LlavaOnevisionForConditionalGeneration",)
    model_type = "llava_onevision"
    display_name = "LLaVA-OneVision (SigLIP tower, anyres-max tiling, Qwen2 decoder)"
    model_class = ModelClass("mmengine.models.llava_onevision_model", "LlavaOnevisionModel")

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        check_onevision_config(hf_config)
        self.anyres = AnyresSettings.from_config(hf_config)
        self.video = onevision_video.load_video_settings(model_dir, self.anyres.tile)
        if (self.video.height, self.video.width) != (self.anyres.tile, self.anyres.tile):
            raise UnsupportedModelError(f"video frames of {self.video.width}x{self.video.height} px are not supported: the "
                                        f"tower's features are pooled as {self.anyres.tile} px squares")

    full_processor_reason = ""

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """load_processor's parts: the tokenizer, the PIL image processor, the saved chat template and the image
        and video tokens its processor class takes."""
        from mmengine.multimodal.light_processor import (
            LightProcessor, checkpoint_text_parts, special_token, unpickled_without_modeling_code,
        )

        tokenizer, saved = checkpoint_text_parts(model_dir)
        from transformers import LlavaOnevisionImageProcessorPil

        image_processor = LlavaOnevisionImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **overrides)
        return LightProcessor(
            tokenizer, unpickled_without_modeling_code(image_processor), saved.get("chat_template") or tokenizer.chat_template,
            special_token(tokenizer, "image_token", saved.get("image_token") or "<image>"),
            special_token(tokenizer, "video_token", saved.get("video_token") or "<video>"),
        )

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """transformers' LlavaOnevisionProcessor from the tokenizer, the PIL image processor and the saved
        processor settings (num_image_tokens, vision_aspect_ratio, ...), without its torchvision-only video
        processor, so it is the same processor whether or not torchvision is installed."""
        from transformers import AutoTokenizer, LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

        from mmengine.models.qwen_vl import image_only_processor_class

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        image_processor = LlavaOnevisionImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **overrides)
        saved, _ = LlavaOnevisionProcessor.get_processor_dict(model_dir, local_files_only=True)
        settings = {name: saved[name] for name in ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio",
                                                   "image_token", "video_token") if saved.get(name) is not None}
        return image_only_processor_class(LlavaOnevisionProcessor)(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=saved.get("chat_template") or tokenizer.chat_template,
            **settings,
        )

    # -- items --

    def max_tokens_by_modality(self) -> dict[str, int]:
        return {"image": self.anyres.max_tokens()[0], "video": self.tokens_per_frame + 1}

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        settings = self.anyres
        most, (height, width) = settings.max_tokens()
        return (f"{settings.side}x{settings.side} features per {settings.tile} px tile: the whole picture as one tile, then "
                f"the tiles of its pinpoint (up to {height}x{width} px, {(height // settings.tile) * (width // settings.tile)} "
                f"tiles) unpadded, at most anyres_max_{settings.max_tiles} tiles' worth, a newline per row: at most {most}; "
                f"videos: one item per frame of {self.tokens_per_frame} (the last one more, the newline)")

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        """One entry per picture: its tiles (the base tile first, without the batch's padding tiles) and its
        original (height, width)."""
        pixel_values, sizes = batch["pixel_values"], batch["image_sizes"]
        if pixel_values.shape[0] != num_images or sizes.shape[0] != num_images:
            raise UnsupportedModelError(f"the image processor returned {pixel_values.shape[0]} images for {num_images}")
        items = []
        for picture, size in zip(pixel_values, sizes):
            tiles = self.anyres.num_tiles(*(int(x) for x in size.tolist()))
            pixels = picture[:tiles] if num_images == 1 and tiles == picture.shape[0] else picture[:tiles].clone()
            items.append(EncoderInputs(pixel_values=pixels, image_size=size.clone()))
        return items

    def num_tokens(self, inputs: EncoderInputs) -> int:
        if "image_embeds" in inputs:
            return int(inputs["image_embeds"].shape[0])
        height, width = (int(x) for x in inputs["image_size"].tolist())
        return self.anyres.num_tokens(height, width)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The pinpoint the picture is resized and padded into (the largest array preprocessing makes)."""
        return self.anyres.best_resolution(height, width)

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        """Items of the most tower rows one item's share of the encoder budget can bring: the largest picture's
        tiles, or as many video frames (the fewest embeddings a row) as the largest item's embeddings; given
        as frames, which the model pools whatever their count."""
        _, (height, width) = self.anyres.max_tokens()
        rows = max(self.anyres.num_tiles(height, width), self.max_tokens_per_item() // self.tokens_per_frame)
        tile = self.anyres.tile
        return [EncoderInputs(pixel_values_videos=torch.zeros(rows, 3, tile, tile)) for _ in range(num_items)]

    # -- videos --

    @property
    def video_token_id(self) -> int | None:
        return self.hf_config.video_token_id

    @property
    def tokens_per_frame(self) -> int:
        return math.ceil(self.anyres.side / 2) ** 2

    @property
    def max_items_per_video(self) -> int:
        """As many frames as the decoder's positions can hold."""
        return max(1, self.text_config.max_position_embeddings // self.tokens_per_frame)

    def plan_video(self, info: Any, video: Any, keep_all_frames: bool = False) -> VideoPlan:
        indices = onevision_video.sample_indices(self.video, info.num_frames, info.fps, video.fps, video.num_frames, keep_all_frames)
        return VideoPlan(
            indices=tuple(indices), source_fps=info.fps, source_frames=info.num_frames, height=self.video.height,
            width=self.video.width, num_patches=len(indices), tokens_per_patch=self.tokens_per_frame, time_step=1.0,
            timestamps=tuple(index / info.fps for index in indices), trailing_tokens=1,
        )

    def video_items(self, frames: np.ndarray, plan: VideoPlan) -> list[EncoderInputs]:
        pixels = onevision_video.frame_pixels(self.video, frames)
        items = [EncoderInputs(pixel_values_videos=pixels[k:k + 1].clone()) for k in range(len(pixels))]
        items[-1]["ends_video"] = torch.ones(1, dtype=torch.bool)
        return items
