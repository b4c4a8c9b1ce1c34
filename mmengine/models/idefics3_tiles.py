"""Idefics3 / SmolVLM image splitting: the sizes transformers' image processor gives a picture, and the text
its processor writes in the picture's marker.

The image processor resizes every picture (up or down) to `size["longest_edge"]` (at most 4096 px), then,
with `do_image_splitting`, up to whole multiples of the tile side (`max_image_size["longest_edge"]`) and cuts
it into rows x cols tiles, followed by the whole picture resized to one tile (the global image); a picture
that fits one tile, or any picture without splitting, is the global image alone. Each tile and the global
image make the same run of `image_seq_len` tokens; the processor writes them as

    <fake_token_around_image><row_1_col_1><image>*N ... <fake_token_around_image><row_1_col_C><image>*N\\n
    ...(one line per row)
    \\n<fake_token_around_image><global-img><image>*N<fake_token_around_image>

and a picture that is not split as `<fake_token_around_image><global-img><image>*N<fake_token_around_image>`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mmengine.errors import UnsupportedModelError


def _edge(value: Any, name: str) -> int | None:
    """A size setting's longest_edge (a dict or transformers' SizeDict)."""
    if value is None:
        return None
    edge = value.get("longest_edge") if isinstance(value, Mapping) else getattr(value, "longest_edge", None)
    if edge is None:
        raise UnsupportedModelError(f"image processor setting {name}={value!r} is not supported: Idefics3's processor "
                                    "takes a longest_edge")
    return int(edge)


@dataclass(frozen=True)
class TileSettings:
    tile: int  # the tile side, max_image_size's longest_edge
    longest_edge: int | None  # what every picture is first resized to (None: do_resize off)
    splitting: bool  # do_image_splitting

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], default_tile: int) -> TileSettings:
        """From the image processor's settings (registry.image_processor_settings), the tile side falling back
        to `default_tile` (the tower's input) where they give none."""
        tile = _edge(settings.get("max_image_size"), "max_image_size") or default_tile
        longest = _edge(settings.get("size"), "size") if settings.get("do_resize", True) else None
        return cls(tile, longest, bool(settings.get("do_image_splitting", True)))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the longest-edge resize, by transformers' own rule."""
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            MAX_IMAGE_SIZE,
            _resize_output_size_rescale_to_max_len,
            _resize_output_size_scale_below_upper_bound,
        )

        if self.longest_edge is None:
            return height, width
        height, width = _resize_output_size_rescale_to_max_len(height, width, max_len=self.longest_edge)
        return _resize_output_size_scale_below_upper_bound(height, width, max_len=MAX_IMAGE_SIZE)

    def split_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the array the picture's tiles are cut from (resize_for_vision_encoder), or the
        tile's square without splitting: the largest array preprocessing makes of it."""
        height, width = self.resized_size(height, width)
        if not self.splitting:
            return self.tile, self.tile
        aspect_ratio = width / height
        if width >= height:
            width = math.ceil(width / self.tile) * self.tile
            height = math.ceil(int(width / aspect_ratio) / self.tile) * self.tile
        else:
            height = math.ceil(height / self.tile) * self.tile
            width = math.ceil(int(height * aspect_ratio) / self.tile) * self.tile
        return height, width

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles a picture of this size is cut into; (0, 0): not split (the global image alone)."""
        height, width = self.split_size(height, width)
        if height > self.tile or width > self.tile:
            return height // self.tile, width // self.tile
        return 0, 0

    @property
    def max_grid(self) -> tuple[int, int] | None:
        """The most rows and columns a picture can be cut into (a square picture's, at the longest edge); None
        where no resize bounds them (do_resize off)."""
        from transformers.models.idefics3.image_processing_pil_idefics3 import MAX_IMAGE_SIZE

        if not self.splitting:
            return 0, 0
        if self.longest_edge is None:
            return None
        side = math.ceil(min(self.longest_edge, MAX_IMAGE_SIZE) / self.tile)
        return (side, side) if side > 1 else (0, 0)

    @property
    def max_items(self) -> int:
        """The most items (tiles and the global image) a picture makes; without a resize, those of a picture of
        the largest side transformers' resize would give (a bound, not a rule)."""
        from transformers.models.idefics3.image_processing_pil_idefics3 import MAX_IMAGE_SIZE

        rows, cols = self.max_grid or (math.ceil(MAX_IMAGE_SIZE / self.tile),) * 2
        return rows * cols + 1


@dataclass(frozen=True)
class MarkerTokens:
    """The processor's tokens around a picture's runs."""

    fake: str  # <fake_token_around_image>
    global_image: str  # <global-img>
    image: str  # <image>

    def text(self, rows: int, cols: int, run: str | None = None) -> str:
        """The processor's text for a picture cut into rows x cols tiles ((0, 0): not split), with `run` (by default
        one image token) where each tile's and the global image's run goes."""
        run = self.image if run is None else run
        rows_text = "".join("".join(f"{self.fake}<row_{row}_col_{col}>{run}" for col in range(1, cols + 1)) + "\n"
                            for row in range(1, rows + 1))
        whole = f"{self.fake}{self.global_image}{run}{self.fake}"
        return f"{rows_text}\n{whole}" if rows or cols else whole
