"""Llama 4's image tiles and prompt text without torchvision (transformers' Llama4ImageProcessor needs it).

The rules are transformers' Llama4ImageProcessor's: the canvases are every grid of at most `max_patches` square
tiles of `size` (find_supported_resolutions' order); the picture gets the canvas needing the least upscaling
(else the least downscaling; the smaller area on a tie), is resized without distortion to fit it (never upscaled
beyond the tile size unless `resize_to_max_canvas`), padded right and bottom with black, rescaled and normalized
in bfloat16 (as the original implementation), and cut into the grid's tiles, row by row; a picture of more than
one tile is also resized whole to one tile, the global tile, after them. The resize is torch's antialiased bilinear
interpolate on the uint8 pixels, which torchvision's resize (what transformers calls) runs for uint8 pictures on
CPUs with AVX2.

Llama4Processor writes a picture as `<|image_start|>`, for a grid of tiles each row's tiles' runs of `<|patch|>`
separated by `<|tile_x_separator|>` and ended by `<|tile_y_separator|>`, then `<|image|>`, the global (or only)
tile's run, `<|image_end|>` (its `_prompt_split_image`, called here).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmengine.errors import InvalidInputError, UnsupportedModelError

IMAGE_START, IMAGE_END, IMAGE, PATCH = "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>"
TILE_X, TILE_Y = "<|tile_x_separator|>", "<|tile_y_separator|>"
MARKERS = (IMAGE_START, IMAGE_END, IMAGE, PATCH, TILE_X, TILE_Y)


def supported_resolutions(max_tiles: int, tile: int) -> list[tuple[int, int]]:
    """Every canvas (height, width) of at most `max_tiles` tiles, in find_supported_resolutions' order."""
    by_ratio: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for count in range(max_tiles, 0, -1):
        factors = sorted({f for i in range(1, int(count**0.5) + 1) if count % i == 0 for f in (i, count // i)})
        for rows in factors:
            by_ratio[rows / (count // rows)].append((rows, count // rows))
    return [(rows * tile, cols * tile) for grids in by_ratio.values() for rows, cols in grids]


def best_canvas(height: int, width: int, resolutions: list[tuple[int, int]], to_max_canvas: bool) -> tuple[int, int]:
    """transformers' get_best_fit, in the same tensor arithmetic (so ties break alike)."""
    possible = torch.tensor(resolutions)
    scale_w, scale_h = possible[:, 1] / width, possible[:, 0] / height
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    upscaling = scales[scales >= 1]
    if len(upscaling) > 0:
        selected = torch.max(upscaling) if to_max_canvas else torch.min(upscaling)
    else:
        selected = torch.max(scales[scales < 1])
    chosen = possible[scales == selected]
    best = chosen[torch.argmin(chosen[:, 0] * chosen[:, 1])] if len(chosen) > 1 else chosen[0]
    return int(best[0]), int(best[1])


def size_without_distortion(height: int, width: int, target_height: int, target_width: int) -> tuple[int, int]:
    """transformers' get_max_res_without_distortion (at least one pixel a side)."""
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return max(min(math.floor(height * scale_w), target_height), 1), max(target_width, 1)
    return max(target_height, 1), max(min(math.floor(width * scale_h), target_width), 1)


class Llama4TileProcessor:
    """Llama4ImageProcessor's preprocessing (module docstring): pixel_values [tiles of all pictures, 3, S, S] and
    aspect_ratios [pictures, 2] (the grid's rows and columns)."""

    def __init__(self, size: dict[str, int] | None = None, max_patches: int = 16, resize_to_max_canvas: bool = False,
                 rescale_factor: float = 1 / 255, image_mean: list[float] | None = None, image_std: list[float] | None = None,
                 do_convert_rgb: bool = True, **ignored: Any) -> None:
        size = dict(size or {"height": 336, "width": 336})
        if size.get("height") != size.get("width"):
            raise UnsupportedModelError(f"Llama 4's tiles are square; the image processor's size is {size}")
        self.size = size
        self.max_patches = int(max_patches)
        self.resize_to_max_canvas = bool(resize_to_max_canvas)
        self.rescale_factor = float(rescale_factor)
        self.image_mean = list(image_mean or [0.5, 0.5, 0.5])
        self.image_std = list(image_std or [0.5, 0.5, 0.5])
        self.do_convert_rgb = bool(do_convert_rgb)

    @classmethod
    def from_pretrained(cls, model_dir: str, overrides: dict[str, Any]) -> Llama4TileProcessor:
        path = Path(model_dir) / "preprocessor_config.json"
        saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        if saved.get("do_resize") is False or overrides.get("do_resize") is False:
            raise UnsupportedModelError("Llama 4 always resizes pictures to a canvas of tiles: do_resize=False is not supported")
        return cls(**{**saved, **overrides})

    @property
    def tile(self) -> int:
        return int(self.size["height"])

    def to_dict(self) -> dict[str, Any]:
        return {"image_processor_type": type(self).__name__, **vars(self)}

    def canvas(self, height: int, width: int) -> tuple[int, int]:
        return best_canvas(height, width, supported_resolutions(self.max_patches, self.tile), self.resize_to_max_canvas)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The size the picture is resized to before padding to its canvas."""
        target_h, target_w = self.canvas(height, width)
        if not self.resize_to_max_canvas:
            target_h, target_w = min(max(height, self.tile), target_h), min(max(width, self.tile), target_w)
        return size_without_distortion(height, width, target_h, target_w)

    def _normalized(self, pixels: torch.Tensor) -> torch.Tensor:
        """[3, H, W] uint8 pixels rescaled and normalized in bfloat16, as transformers' rescale_and_normalize."""
        x = pixels.to(torch.bfloat16) * self.rescale_factor
        mean = torch.tensor(self.image_mean, dtype=torch.bfloat16)[:, None, None]
        std = torch.tensor(self.image_std, dtype=torch.bfloat16)[:, None, None]
        return ((x - mean) / std).float()

    def tiles(self, picture: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """One picture's tiles [rows x cols (+1 global), 3, S, S] and its grid (rows, cols)."""
        if self.do_convert_rgb or picture.mode != "RGB":
            picture = picture.convert("RGB")
        width, height = picture.size
        canvas_h, canvas_w = self.canvas(height, width)
        new_h, new_w = self.resized_size(height, width)
        pixels = torch.from_numpy(np.asarray(picture, dtype=np.uint8).copy()).permute(2, 0, 1)[None]
        padded = torch.zeros(3, canvas_h, canvas_w, dtype=torch.uint8)  # black right and below
        padded[:, :new_h, :new_w] = _resized(pixels, new_h, new_w)
        tile, rows, cols = self.tile, canvas_h // self.tile, canvas_w // self.tile
        tiles = self._normalized(padded).view(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, tile, tile)
        if rows * cols > 1:
            tiles = torch.cat([tiles, self._normalized(_resized(pixels, tile, tile))[None]])
        return tiles, (rows, cols)

    def __call__(self, images: Any = None, return_tensors: str | None = "pt", **kwargs: Any) -> Any:
        from transformers import BatchFeature

        pictures = images if isinstance(images, (list, tuple)) else [images]
        done = [self.tiles(picture) for picture in pictures]
        return BatchFeature({"pixel_values": torch.cat([tiles for tiles, _ in done]),
                             "aspect_ratios": torch.tensor([grid for _, grid in done])})


def _resized(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[1, 3, H, W] uint8 -> [3, height, width] uint8: antialiased bilinear, as torchvision resizes uint8 pictures."""
    return torch.nn.functional.interpolate(pixels, size=(height, width), mode="bilinear", antialias=True, align_corners=False)[0]


def image_string(grid: tuple[int, int], tokens_per_tile: int) -> str:
    """Llama4Processor's text for a picture of this grid (its _prompt_split_image, which reads nothing of the processor)."""
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    return Llama4Processor._prompt_split_image(None, grid, tokens_per_tile)


class Llama4PromptProcessor:
    """Llama4Processor's text-and-image half over Llama4TileProcessor: each `<|image|>` marker becomes its picture's
    text (image_string)."""

    image_token = IMAGE
    patch_token = PATCH

    def __init__(self, image_processor: Llama4TileProcessor, tokenizer: Any, chat_template: str | None, patch_size: int,
                 pixel_shuffle_ratio: float) -> None:
        self.image_processor, self.tokenizer, self.chat_template = image_processor, tokenizer, chat_template
        tile = image_processor.tile // patch_size
        self.tokens_per_tile = int(tile * tile // int(round(1.0 / pixel_shuffle_ratio**2)))

    def expand(self, text: str, grids: list[tuple[int, int]]) -> str:
        pieces = text.split(IMAGE)
        out = pieces[0]
        for grid, piece in zip(grids, pieces[1:]):
            out += image_string(grid, self.tokens_per_tile) + piece
        return out

    def __call__(self, text: str | list[str], images: Any = None, return_tensors: str | None = None, **kwargs: Any) -> Any:
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        data: dict[str, Any] = {}
        markers = sum(t.count(IMAGE) for t in texts)
        if markers != len(images or ()):
            raise InvalidInputError(f"the text has {markers} {IMAGE} marker(s) but {len(images or ())} image(s) were given")
        if images:
            data = dict(self.image_processor(images))
            grids = [tuple(int(v) for v in grid) for grid in data["aspect_ratios"]]
            expanded = []
            for t in texts:
                expanded.append(self.expand(t, grids[: t.count(IMAGE)]))
                grids = grids[t.count(IMAGE):]
            texts = expanded
            data.pop("aspect_ratios")
        data.update(self.tokenizer(texts, return_tensors=return_tensors, **kwargs))
        return BatchFeature(data, tensor_type=return_tensors)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(conversation, **kwargs)


def marker_ids(model_dir: str | None) -> dict[str, int]:
    """The ids of Llama 4's image markers, read from the tokenizer files without loading the tokenizer."""
    if model_dir is None:
        raise UnsupportedModelError("Llama 4 needs its checkpoint directory to read the image marker ids")
    directory, ids = Path(model_dir), {}
    if (directory / "tokenizer.json").is_file():
        tokenizer = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        ids.update({token["content"]: int(token["id"]) for token in tokenizer.get("added_tokens", [])})
    if (directory / "tokenizer_config.json").is_file():
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        ids.update({entry["content"]: int(key) for key, entry in (config.get("added_tokens_decoder") or {}).items()})
    missing = [name for name in MARKERS if name not in ids]
    if missing:
        raise UnsupportedModelError(f"the tokenizer has no {' / '.join(missing)} token")
    return {name: ids[name] for name in MARKERS}
