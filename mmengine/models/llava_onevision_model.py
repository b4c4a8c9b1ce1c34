"""LLaVA-OneVision's model (LlavaOnevisionFamily's model_class): LLaVA's tower, projector and decoder, plus the newline
embedding that ends each row of tile features; the family (anyres-max tiles, videos) is in llava_onevision.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.models.anyres import AnyresSettings, pack_features
from mmengine.models.llava_model import LlavaModel
from mmengine.models.llava_onevision import check_onevision_config


class LlavaOnevisionModel(LlavaModel):
    """LLaVA's tower, projector and decoder, plus the newline embedding that ends each row of tile features."""

    def __init__(self, config: PretrainedConfig) -> None:
        check_onevision_config(config)
        super().__init__(config)
        self.anyres = AnyresSettings.from_config(config)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

    def encoder_rows(self, item: dict[str, torch.Tensor]) -> int:
        return int(_pixels(item).shape[0])

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """A step's pictures ({"pixel_values": [tiles, 3, S, S], "image_size": [2]}, all their tiles) and video
        frames ({"pixel_values_videos": [1, 3, S, S]}, the video's last with "ends_video") through the tower as
        one batch; one [tokens, text_hidden] run per item, in order: a picture's packed tiles, a frame's pooled
        features (and the newline after the video's last)."""
        pixel_values = torch.cat([_pixels(item) for item in items])
        if self.device.type == "cuda":
            pixel_values = pixel_values.pin_memory()
        features = self.encode_images(pixel_values.to(self.device, non_blocking=True))
        runs = []
        for item, rows in zip(items, torch.split(features, [self.encoder_rows(item) for item in items])):
            if "pixel_values_videos" in item:
                run = self._pool_frames(rows).flatten(0, 1)
                if "ends_video" in item:
                    run = torch.cat((run, self.image_newline[None].to(run.dtype)))
                runs.append(run)
                continue
            height, width = (int(x) for x in item["image_size"].tolist())
            runs.append(pack_features(rows, height, width, self.anyres, self.image_newline))
        return runs

    def _pool_frames(self, features: torch.Tensor) -> torch.Tensor:
        """[frames, side*side, hidden] -> [frames, ceil(side/2)^2, hidden] (transformers' apply_pooling)."""
        side, pooled = self.anyres.side, math.ceil(self.anyres.side / 2)
        grid = features.view(features.shape[0], side, side, -1).permute(0, 3, 1, 2)
        grid = nn.functional.interpolate(grid, size=[pooled, pooled], mode="bilinear")
        return grid.permute(0, 2, 3, 1).reshape(features.shape[0], pooled * pooled, -1)


def _pixels(item: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return item["pixel_values_videos"] if "pixel_values_videos" in item else item["pixel_values"]
