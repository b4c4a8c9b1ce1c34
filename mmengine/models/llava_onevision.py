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

Videos: transformers' video processor needs torchvision; videos are refused by name (see `video_token_id`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.models.anyres import AnyresSettings, pack_features
from mmengine.models.family import EncoderInputs, ModelFamily
from mmengine.models.llava import LlavaModel

SUPPORTED_VISION_MODEL_TYPES = ("siglip_vision_model",)


def _check_config(config: PretrainedConfig) -> None:
    vision_type = config.vision_config.model_type
    if vision_type not in SUPPORTED_VISION_MODEL_TYPES:
        raise UnsupportedModelError(f"vision tower {vision_type!r} is not supported; supported: {', '.join(SUPPORTED_VISION_MODEL_TYPES)}")
    if config.vision_feature_select_strategy != "full":  # transformers' packing needs every patch of a tile
        raise UnsupportedModelError(f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is not supported "
                                    "(LLaVA-OneVision's tiles keep every patch: 'full')")


class LlavaOnevisionModel(LlavaModel):
    """LLaVA's tower, projector and decoder, plus the newline embedding that ends each row of tile features."""

    def __init__(self, config: PretrainedConfig) -> None:
        _check_config(config)
        super().__init__(config)
        self.anyres = AnyresSettings.from_config(config)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

    def encoder_rows(self, item: dict[str, torch.Tensor]) -> int:
        return int(item["pixel_values"].shape[0])

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """A step's pictures ({"pixel_values": [tiles, 3, S, S], "image_size": [2]}) with all their tiles through
        the tower as one batch; one packed [tokens, text_hidden] run per picture, in order."""
        pixel_values = torch.cat([item["pixel_values"] for item in items])
        if self.device.type == "cuda":
            pixel_values = pixel_values.pin_memory()
        features = self.encode_images(pixel_values.to(self.device, non_blocking=True))
        runs = []
        for item, tiles in zip(items, torch.split(features, [self.encoder_rows(item) for item in items])):
            height, width = (int(x) for x in item["image_size"].tolist())
            runs.append(pack_features(tiles, height, width, self.anyres, self.image_newline))
        return runs


class LlavaOnevisionFamily(ModelFamily):
    architectures = ("LlavaOnevisionForConditionalGeneration",)
    model_type = "llava_onevision"
    display_name = "LLaVA-OneVision (SigLIP tower, anyres-max tiling, Qwen2 decoder)"
    model_class = LlavaOnevisionModel

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        _check_config(hf_config)
        self.anyres = AnyresSettings.from_config(hf_config)

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
        return {"image": self.anyres.max_tokens()[0]}

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        settings = self.anyres
        most, (height, width) = settings.max_tokens()
        return (f"{settings.side}x{settings.side} features per {settings.tile} px tile: the whole picture as one tile, then "
                f"the tiles of its pinpoint (up to {height}x{width} px, {(height // settings.tile) * (width // settings.tile)} "
                f"tiles) unpadded, at most anyres_max_{settings.max_tiles} tiles' worth, a newline per row: at most {most}")

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
        """Pictures of the most tiles (a picture exactly the largest pinpoint's size)."""
        _, (height, width) = self.anyres.max_tokens()
        tiles = self.anyres.num_tiles(height, width)
        size, tile = torch.tensor([height, width]), self.anyres.tile
        return [EncoderInputs(pixel_values=torch.zeros(tiles, 3, tile, tile), image_size=size.clone()) for _ in range(num_items)]
