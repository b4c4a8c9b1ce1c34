"""InternVL 3 / 3.5 (`InternVLForConditionalGeneration`, the published *-HF checkpoints): transformers'
InternViT tower (InternVLVisionModel) and pixel-shuffle projector over the engine's Qwen3 / Qwen2 / Llama
decoder.

A picture is cut into tiles of the tower's square (448 px in the releases) by the GOT-OCR2 image processor's
dynamic tiling: the grid of min_patches..max_patches tiles whose aspect ratio is closest to the picture's,
plus a thumbnail of the whole picture when there is more than one tile. Every tile goes through the tower; its
patch states (CLS dropped) are pixel-shuffled by downsample_ratio and projected: image_seq_length embeddings
a tile. The processor writes a picture's runs back to back between `<img>` and `</img>`, so the whole picture
is one item (one encoder-cache entry, all its tiles), hashed on its pixels and the processor settings (the
tiling ones among them). Positions are plain 1-D.

transformers' InternVLProcessor tiles every picture (its crop_to_patches default wins over the saved
setting); the engine calls the image processor alone, so load_processor sets the same value on both. Videos
are refused by name: transformers' video processor needs torchvision.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from mmengine.errors import InvalidInputError, UnsupportedModelError
from mmengine.models.family import EncoderInputs, ModelClass, ModelFamily


def tile_side(config: PretrainedConfig) -> tuple[int, int]:
    """(tile side in px, patches along it)."""
    vision = config.vision_config
    tile, patch = vision.image_size[0], vision.patch_size[0]
    return tile, tile // patch


def check_internvl_config(config: PretrainedConfig) -> None:
    vision = config.vision_config
    if vision.image_size[0] != vision.image_size[1] or vision.patch_size[0] != vision.patch_size[1]:
        raise UnsupportedModelError(f"InternViT tiles of {vision.image_size} px in patches of {vision.patch_size} px are "
                                    "not supported: square tiles and patches only")
    if config.vision_feature_layer != -1 or config.vision_feature_select_strategy != "default":
        raise UnsupportedModelError(f"vision_feature_layer {config.vision_feature_layer} / vision_feature_select_strategy "
                                    f"{config.vision_feature_select_strategy!r} are not supported (the releases': -1 / 'default')")
    _, side = tile_side(config)
    scale = round(1 / config.downsample_ratio)
    if scale * config.downsample_ratio != 1 or side % scale:
        raise UnsupportedModelError(f"downsample_ratio {config.downsample_ratio} must be 1/k for a k dividing the tile's "
                                    f"{side} patches")


def tokens_per_tile(config: PretrainedConfig) -> int:
    _, side = tile_side(config)
    return round(side * side * config.downsample_ratio**2)


class InternVLFamily(ModelFamily):
    architectures = ("InternVLForConditionalGeneration",)
    model_type = "internvl"
    display_name = "InternVL 3 / 3.5 (InternViT tower, pixel-shuffle projector, dynamic 448 px tiles, Qwen3/Qwen2 decoder)"
    model_class = ModelClass("mmengine.models.internvl_model", "InternVLModel")

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        check_internvl_config(hf_config)
        settings = self.image_processor_settings
        size = settings.get("size") or {}
        self.tile, _ = tile_side(hf_config)
        if size and (size.get("height"), size.get("width")) != (self.tile, self.tile):
            raise UnsupportedModelError(f"the image processor's tiles of {size} px are not the tower's {self.tile} px squares")
        self.crop_to_patches = bool(settings.get("crop_to_patches", True))
        self.min_patches = int(settings.get("min_patches", 1))
        self.max_patches = int(settings.get("max_patches", 12))
        self._boundary_ids: tuple[int, int] | None = None

    full_processor_reason = ""

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """load_processor's parts: the tokenizer, the PIL GOT-OCR2 image processor (crop_to_patches as there), the
        saved chat template and the image and video tokens InternVLProcessor takes from the tokenizer."""
        from mmengine.multimodal.light_processor import LightProcessor, checkpoint_text_parts, unpickled_without_modeling_code

        tokenizer, saved = checkpoint_text_parts(model_dir)
        from transformers import GotOcr2ImageProcessorPil, InternVLProcessor

        crop = bool(overrides.get("crop_to_patches", InternVLProcessor.images_kwargs["crop_to_patches"]))
        image_processor = GotOcr2ImageProcessorPil.from_pretrained(model_dir, local_files_only=True,
                                                                   **{**overrides, "crop_to_patches": crop})
        return LightProcessor(
            tokenizer, unpickled_without_modeling_code(image_processor),
            saved.get("chat_template") or tokenizer.chat_template,
            tokenizer.context_image_token, tokenizer.video_token,
        )

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """transformers' InternVLProcessor from the tokenizer, the PIL GOT-OCR2 image processor and the saved
        processor settings (image_seq_length), without its torchvision-only video processor. crop_to_patches
        (InternVLProcessor's default: on) is set alike on the processor and the image processor the engine calls."""
        from transformers import AutoTokenizer, GotOcr2ImageProcessorPil, InternVLProcessor

        from mmengine.models.qwen_vl import image_only_processor_class

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        crop = bool(overrides.get("crop_to_patches", InternVLProcessor.images_kwargs["crop_to_patches"]))
        image_processor = GotOcr2ImageProcessorPil.from_pretrained(model_dir, local_files_only=True,
                                                                   **{**overrides, "crop_to_patches": crop})
        saved, _ = InternVLProcessor.get_processor_dict(model_dir, local_files_only=True)
        settings = {"image_seq_length": saved["image_seq_length"]} if saved.get("image_seq_length") is not None else {}
        processor = image_only_processor_class(InternVLProcessor)(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=saved.get("chat_template") or tokenizer.chat_template,
            **settings,
        )
        processor.images_kwargs = {"crop_to_patches": crop}
        return processor

    # -- items --

    @property
    def tokens_per_tile(self) -> int:
        return tokens_per_tile(self.hf_config)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles for a height x width picture (GOT-OCR2's choice); (1, 1) when not tiled."""
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

        if not self.crop_to_patches or self.max_patches <= 1:
            return 1, 1
        cols, rows = get_optimal_tiled_canvas((height, width), (self.tile, self.tile), self.min_patches, self.max_patches)
        return rows, cols

    def num_tiles(self, height: int, width: int) -> int:
        """The tower's inputs for a picture: its tiles, then the thumbnail when there is more than one."""
        rows, cols = self.grid(height, width)
        return rows * cols + (1 if rows * cols > 1 else 0)

    @property
    def max_tiles(self) -> int:
        if not self.crop_to_patches or self.max_patches <= 1:
            return 1
        return self.max_patches + 1

    def max_tokens_by_modality(self) -> dict[str, int]:
        return {"image": self.max_tiles * self.tokens_per_tile}

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        side = self.tile // self.hf_config.vision_config.patch_size[0]
        tiling = (f"{self.min_patches}..{self.max_patches} tiles plus a thumbnail" if self.max_tiles > 1
                  else "one tile (crop_to_patches off)")
        return (f"{self.tile} px tiles of {side}x{side} patches pixel-shuffled by {self.hf_config.downsample_ratio} to "
                f"{self.tokens_per_tile} tokens; a picture is {tiling}: at most {self.max_tiles * self.tokens_per_tile}")

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        """One entry per picture: its tiles then its thumbnail ([tiles, 3, S, S])."""
        pixel_values = batch["pixel_values"]
        counts = batch.get("num_patches")
        counts = [1] * pixel_values.shape[0] if counts is None else [int(c) for c in _as_list(counts)]
        if len(counts) != num_images or sum(counts) != pixel_values.shape[0]:
            raise UnsupportedModelError(f"the image processor returned {pixel_values.shape[0]} tiles in {counts} "
                                        f"for {num_images} images")
        pictures = torch.split(pixel_values, counts)
        return [EncoderInputs(pixel_values=p if num_images == 1 else p.clone()) for p in pictures]

    def image_items(self, inputs: EncoderInputs) -> list[EncoderInputs]:
        """The picture itself; precomputed embeddings must be whole tiles' runs (the most a picture makes at most)."""
        if "image_embeds" in inputs:
            rows, most = int(inputs["image_embeds"].shape[0]), self.max_tiles * self.tokens_per_tile
            if rows % self.tokens_per_tile or not 0 < rows <= most:
                raise InvalidInputError(f"image_embeds has {rows} rows; InternVL takes whole tiles' runs: a multiple of "
                                        f"{self.tokens_per_tile} up to {most}")
        return [inputs]

    def num_tokens(self, inputs: EncoderInputs) -> int:
        if "image_embeds" in inputs:
            return int(inputs["image_embeds"].shape[0])
        return int(inputs["pixel_values"].shape[0]) * self.tokens_per_tile

    def image_prompt_ids(self, num_tokens: int) -> tuple[list[int], int]:
        """A picture's run between `<img>` and `</img>`, as InternVLProcessor writes it (a token prompt's single
        placeholder is expanded so too)."""
        start, end = self.boundary_ids
        return [start, *[self.image_token_id] * num_tokens, end], 1

    @property
    def boundary_ids(self) -> tuple[int, int]:
        """The ids of the tokenizer's start_image_token and end_image_token (`<img>`, `</img>`)."""
        if self._boundary_ids is None:
            self._boundary_ids = _boundary_ids(self.model_dir)
        return self._boundary_ids

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The canvas the picture is resized to before it is cut into tiles (the largest array preprocessing makes)."""
        rows, cols = self.grid(height, width)
        return rows * self.tile, cols * self.tile

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        return [EncoderInputs(pixel_values=torch.zeros(self.max_tiles, 3, self.tile, self.tile)) for _ in range(num_items)]


def _as_list(values: Any) -> list[Any]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _boundary_ids(model_dir: str | None) -> tuple[int, int]:
    """`<img>` / `</img>` ids from the checkpoint's tokenizer files (tokenizer_config.json names them,
    tokenizer.json numbers them), without loading the tokenizer."""
    if model_dir is None:
        raise UnsupportedModelError("InternVL needs its checkpoint directory to read the <img> / </img> token ids")
    directory = Path(model_dir)
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    named = config.get("extra_special_tokens") or {}
    named = {**config, **named} if isinstance(named, dict) else config  # (older files name them at the top level)
    names = (str(named.get("start_image_token", "<img>")), str(named.get("end_image_token", "</img>")))
    ids = {token["content"]: int(token["id"]) for token in json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
           .get("added_tokens", [])}
    ids.update({entry["content"]: int(key) for key, entry in (config.get("added_tokens_decoder") or {}).items()})
    missing = [name for name in names if name not in ids]
    if missing:
        raise UnsupportedModelError(f"the tokenizer has no {' / '.join(missing)} token")
    return ids[names[0]], ids[names[1]]
