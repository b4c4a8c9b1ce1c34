"""LLaVA-NeXT / OneVision "anyres" tiling: which grid of tiles a picture is cut into, how many features its
tiles make once the padding is cut off (and, under `anyres_max_N`, once they are interpolated down to
about N tiles' worth), and how the tiles' features are packed into one run with a newline per row.

The rules are transformers' (LlavaOnevisionProcessor._get_number_of_features counts, and
LlavaOnevisionModel.pack_image_features packs); the count is written here as plain integer arithmetic so a
family knows an item's size from its picture's size alone, and `max_tokens` bounds it over every picture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mmengine.errors import UnsupportedModelError


@dataclass(frozen=True)
class AnyresSettings:
    """`pinpoints`: the (height, width) in pixels each tiling covers; `tile`: the tower's square input;
    `side`: patches along a tile's side (side x side features a tile); `max_tiles`: N of anyres_max_N."""

    pinpoints: tuple[tuple[int, int], ...]
    tile: int
    side: int
    max_tiles: int

    @classmethod
    def from_config(cls, config) -> AnyresSettings:
        vision = config.vision_config
        aspect = str(getattr(config, "vision_aspect_ratio", "anyres_max_9"))
        if not aspect.startswith("anyres_max_") or not aspect.removeprefix("anyres_max_").isdigit():
            raise UnsupportedModelError(f"vision_aspect_ratio {aspect!r} is not supported (expected anyres_max_<N>)")
        pinpoints = tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints)
        if not pinpoints or any(h % vision.image_size or w % vision.image_size for h, w in pinpoints):
            raise UnsupportedModelError(f"image_grid_pinpoints {list(pinpoints)} must be multiples of the tower's "
                                        f"{vision.image_size} px tiles")
        return cls(pinpoints, vision.image_size, vision.image_size // vision.patch_size, int(aspect.removeprefix("anyres_max_")))

    def best_resolution(self, height: int, width: int) -> tuple[int, int]:
        """The pinpoint a height x width picture is resized and padded into (transformers' own choice)."""
        # (transformers' image processing code, imported without its modeling code where nothing imported it yet)
        from mmengine.multimodal.light_processor import import_processing_code

        import_processing_code()
        from transformers.image_processing_utils import select_best_resolution

        return tuple(select_best_resolution((height, width), [list(p) for p in self.pinpoints]))

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Tiles down and across for a picture of this size."""
        best_height, best_width = self.best_resolution(height, width)
        return best_height // self.tile, best_width // self.tile

    def num_tiles(self, height: int, width: int) -> int:
        """The tower's inputs for a picture: the whole picture resized to one tile, then each tile."""
        rows, cols = self.grid(height, width)
        return 1 + rows * cols

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of a height x width picture: the base tile's features, then the tiles' features
        (unpadded, maybe interpolated down) with one newline after each row."""
        rows, cols = self.grid(height, width)
        feature_rows, feature_cols = unpadded_shape(height, width, rows * self.side, cols * self.side)
        return self.side * self.side + _packed(feature_rows, feature_cols, self.side, self.max_tiles)

    def max_tokens(self) -> tuple[int, tuple[int, int]]:
        """A bound on any picture's tokens (over every tiling and every unpadded shape it can leave), and the
        pinpoint of the most tiles (the largest tower batch one picture makes)."""
        most = 0
        for height, width in self.pinpoints:
            rows, cols = height // self.tile * self.side, width // self.tile * self.side
            shapes = [(rows, w) for w in range(1, cols + 1)] + [(h, cols) for h in range(1, rows + 1)]
            most = max(most, max(_packed(h, w, self.side, self.max_tiles) for h, w in shapes))
        largest = max(self.pinpoints, key=lambda p: (p[0] // self.tile) * (p[1] // self.tile))
        return self.side * self.side + most, largest


def unpadded_shape(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """The feature grid (rows x cols) of the resized-and-padded picture with its padding bands cut off
    (transformers' unpad_image on the shape alone)."""
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        return rows - 2 * ((rows - new_rows) // 2), cols
    new_cols = int(round(width * (rows / height), 7))
    return rows, cols - 2 * ((cols - new_cols) // 2)


def _interpolated_shape(rows: int, cols: int, side: int, max_tiles: int) -> tuple[int, int]:
    ratio = math.sqrt(rows * cols / (max_tiles * side**2))
    if ratio > 1.1:
        return int(rows // ratio), int(cols // ratio)
    return rows, cols


def _packed(rows: int, cols: int, side: int, max_tiles: int) -> int:
    rows, cols = _interpolated_shape(rows, cols, side, max_tiles)
    return rows * cols + rows  # a newline after each row


def pack_features(features: torch.Tensor, height: int, width: int, settings: AnyresSettings, newline: torch.Tensor) -> torch.Tensor:
    """One picture's projected tile features [tiles, side*side, hidden] (the base tile first) as its run
    [tokens, hidden]: the base tile's features, then the tiles' features laid out as one feature map,
    unpadded, interpolated down under anyres_max_N, each row followed by the newline embedding
    (transformers' LlavaOnevisionModel.pack_image_features for one picture)."""
    side = settings.side
    rows, cols = settings.grid(height, width)
    base, tiles = features[0], features[1:]
    grid = tiles.view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)  # [hidden, rows*side, cols*side]
    keep_rows, keep_cols = unpadded_shape(height, width, rows * side, cols * side)
    top, left = (grid.shape[1] - keep_rows) // 2, (grid.shape[2] - keep_cols) // 2
    grid = grid[:, top:top + keep_rows, left:left + keep_cols]
    out_rows, out_cols = _interpolated_shape(keep_rows, keep_cols, side, settings.max_tiles)
    if (out_rows, out_cols) != (keep_rows, keep_cols):
        grid = nn.functional.interpolate(grid[None], [out_rows, out_cols], mode="bilinear")[0]
    newlines = newline[:, None, None].expand(-1, out_rows, 1).to(grid.dtype)
    grid = torch.cat((grid, newlines), dim=-1)
    return torch.cat((base, grid.flatten(1, 2).transpose(0, 1)), dim=0)
