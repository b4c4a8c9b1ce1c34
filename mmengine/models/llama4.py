"""Llama 4 (`Llama4ForConditionalGeneration`: Scout, Maverick): transformers' Llama4VisionModel (2-D RoPE ViT over
square tiles, pixel shuffle and its MLP adapter) and multi-modal projector under Llama 4's decoder
(models/llama4_text.py: chunked local attention on the RoPE layers, NoPE layers with temperature tuning, MoE).

A picture is cut into a grid of tiles plus a global tile (models/llama4_tiles.py). Its text, from `<|image_start|>`
to `<|image_end|>` with the tile separators and `<|image|>` among the tiles' `<|patch|>` runs, is the picture's one
item and one encoder-cache entry: the encoder output holds the projected patches at the `<|patch|>` positions and
those other tokens' own embeddings elsewhere, as transformers' model leaves them. Positions are plain 1-D.

The chunked layers keep their blocks in the window pool, with the chunk's rule (kv_cache/chunked_attention.py):
kv_cache_windows lists an AttentionChunk for each of them.
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
from mmengine.models.llama4_tiles import (IMAGE, IMAGE_END, IMAGE_START, PATCH, TILE_X, TILE_Y, Llama4PromptProcessor,
                                          Llama4TileProcessor, marker_ids)


def tokens_per_tile(config: PretrainedConfig) -> int:
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    return int(side * side * vision.pixel_shuffle_ratio**2)


class Llama4Family(ModelFamily):
    architectures = ("Llama4ForConditionalGeneration",)
    model_type = "llama4"
    display_name = "Llama 4 (tiled ViT with pixel shuffle, MoE decoder with chunked local attention and NoPE layers)"
    model_class = ModelClass("mmengine.models.llama4_model", "Llama4Model")
    full_processor_reason = ""

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """load_processor's: the engine's own tile and prompt processors import none of transformers' processing code."""
        return cls.load_processor(model_dir, overrides)

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        vision = hf_config.vision_config
        size = self.image_processor_settings.get("size") or {}
        self.tile = int(size.get("height") or vision.image_size)
        if self.tile != vision.image_size:
            raise UnsupportedModelError(f"the image processor's tiles of {self.tile} px are not the tower's {vision.image_size} px")
        self.max_tiles = int(self.image_processor_settings.get("max_patches") or 16)
        self.tokens_per_tile = tokens_per_tile(hf_config)
        self.tiles = Llama4TileProcessor(size={"height": self.tile, "width": self.tile}, max_patches=self.max_tiles,
                                         resize_to_max_canvas=bool(self.image_processor_settings.get("resize_to_max_canvas")))
        self._markers: dict[str, int] | None = None

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """Llama4PromptProcessor over Llama4TileProcessor (transformers' Llama4ImageProcessor needs torchvision)."""
        from transformers import AutoTokenizer

        image_processor = Llama4TileProcessor.from_pretrained(model_dir, overrides)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        path = Path(model_dir) / "processor_config.json"
        saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        template_path = Path(model_dir) / "chat_template.json"
        template = json.loads(template_path.read_text(encoding="utf-8")).get("chat_template") if template_path.is_file() else None
        return Llama4PromptProcessor(image_processor, tokenizer, template or tokenizer.chat_template,
                                     int(saved.get("patch_size", 14)), float(saved.get("pixel_shuffle_ratio", 0.5)))

    # -- text model --

    @property
    def sliding_window(self) -> int | None:
        return None  # chunks are per layer, kept by the attention layers: no cap on max_model_len

    def kv_cache_windows(self) -> list[int | None]:
        from mmengine.models.llama4_text import layer_chunk  # the engine core's question: its decoder's module answers

        return [layer_chunk(self.text_config, index) for index in range(self.text_config.num_hidden_layers)]

    # -- items --

    @property
    def markers(self) -> dict[str, int]:
        if self._markers is None:
            self._markers = marker_ids(self.model_dir)
        return self._markers

    def run_ids(self, grid: tuple[int, int]) -> list[int]:
        """A picture's ids from <|image_start|> to <|image_end|> (Llama4Processor's text, module docstring)."""
        m, run = self.markers, self.tokens_per_tile
        rows, cols = grid
        ids = [m[IMAGE_START]]
        if rows * cols > 1:
            for _ in range(rows):
                for col in range(cols):
                    ids += [self.image_token_id] * run + ([m[TILE_X]] if col < cols - 1 else [])
                ids.append(m[TILE_Y])
        return ids + [m[IMAGE]] + [self.image_token_id] * run + [m[IMAGE_END]]

    def max_tokens_by_modality(self) -> dict[str, int]:
        return {"image": len(self.run_ids((1, self.max_tiles)))}  # every grid of as many tiles makes as long a text

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        return (f"up to max_patches {self.max_tiles} tiles of {self.tile} px and a global tile, {self.tokens_per_tile} tokens "
                f"each after the pixel shuffle, with the separators and markers: at most {self.max_tokens_by_modality()['image']}")

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        """One entry per picture: its tiles (and global tile) and its text's ids."""
        pixel_values, grids = batch["pixel_values"], [tuple(int(v) for v in g) for g in batch["aspect_ratios"]]
        counts = [rows * cols + (rows * cols > 1) for rows, cols in grids]
        if len(grids) != num_images or pixel_values.shape[0] != sum(counts):
            raise UnsupportedModelError(f"the image processor returned {pixel_values.shape[0]} tiles for {num_images} images")
        if num_images == 1:
            return [EncoderInputs(pixel_values=pixel_values, run_ids=torch.tensor(self.run_ids(grids[0])))]
        return [EncoderInputs(pixel_values=tiles.clone(), run_ids=torch.tensor(self.run_ids(grid)))
                for tiles, grid in zip(torch.split(pixel_values, counts), grids)]

    def num_tokens(self, inputs: EncoderInputs) -> int:
        if "image_embeds" in inputs:
            raise InvalidInputError("Llama 4 takes no precomputed image_embeds: a picture's text needs its grid of tiles")
        return int(inputs["run_ids"].shape[0])

    def image_run_ids(self, inputs: EncoderInputs) -> tuple[list[int], int]:
        self.num_tokens(inputs)
        return inputs["run_ids"].tolist(), 0

    def image_marker_text(self, processor: Any, picture: EncoderInputs) -> str | None:
        """One <|patch|> where the picture's text goes (image_run_ids writes it)."""
        return PATCH

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        return self.tiles.canvas(height, width)

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        grid = (1, self.max_tiles)
        tiles = self.max_tiles + (self.max_tiles > 1)
        return [EncoderInputs(pixel_values=torch.zeros(tiles, 3, self.tile, self.tile), run_ids=torch.tensor(self.run_ids(grid)))
                for _ in range(num_items)]
