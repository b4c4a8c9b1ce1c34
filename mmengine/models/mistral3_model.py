"""Mistral 3's model (Mistral3Family's model_class): transformers' Pixtral tower and Mistral 3 projector under the
Mistral decoder, each picture's run closed by [IMG_BREAK] and [IMG_END] embeddings; the family is in mistral3.py.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from mmengine.layers.attention import AttentionMetadata
from mmengine.models.llama import DeepStack
from mmengine.models.llava_model import normalize_llava_weight_name
from mmengine.models.mistral3 import check_mistral3_config
from mmengine.models.vlm import VisionLanguageModel


class Mistral3Model(VisionLanguageModel):
    """transformers' Pixtral tower and Mistral3 projector (the module names transformers gives them) and the decoder."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_mistral3_config(config)
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector
        from transformers.models.pixtral.modeling_pixtral import PixtralVisionModel

        self.config = config
        self.vision_tower = PixtralVisionModel._from_config(config.vision_config, dtype=torch.get_default_dtype(),
                                                            attn_implementation="sdpa")
        self.multi_modal_projector = Mistral3MultiModalProjector(config)
        self._build_text(config)
        self.image_token_id = config.image_token_id
        self.merged_patch = config.vision_config.patch_size * config.spatial_merge_size

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.vision_tower.patch_conv.weight.dtype

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Pictures ({"pixel_values": [3, H, W] at their resized size, "marker_ids": [IMG_BREAK, IMG_END]}) as one
        padded batch (the tower attends within each picture only); one [R * (C + 1), text hidden] run per picture."""
        sizes = [tuple(item["pixel_values"].shape[1:]) for item in items]
        batch = torch.zeros(len(items), 3, max(h for h, _ in sizes), max(w for _, w in sizes))
        for row, item, (h, w) in zip(batch, items, sizes):
            row[:, :h, :w] = item["pixel_values"]
        batch = batch.to(self.device, self.vision_dtype)
        image_sizes = torch.tensor(sizes, device=self.device)
        states = self.vision_tower(batch, image_sizes=image_sizes).last_hidden_state
        features = self.multi_modal_projector(states.squeeze(0), image_sizes)
        grids = [(h // self.merged_patch, w // self.merged_patch) for h, w in sizes]
        runs = []
        for item, (rows, cols), picture in zip(items, grids, torch.split(features, [r * c for r, c in grids])):
            markers = self.embed_tokens(item["marker_ids"].to(self.device)).to(picture.dtype)
            breaks = markers[0].expand(rows, 1, -1).clone()
            breaks[-1, 0] = markers[1]
            runs.append(torch.cat([picture.view(rows, cols, -1), breaks], dim=1).flatten(0, 1))
        return runs

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                deepstack: DeepStack | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, metadata)

    def checkpoint_name(self, raw_name: str) -> str:
        """transformers 5's `model.*` / `lm_head.weight` and the published `language_model.model.*` /
        `language_model.lm_head.weight` layouts."""
        return normalize_llava_weight_name(raw_name)
