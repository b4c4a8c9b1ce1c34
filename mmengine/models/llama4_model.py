"""Llama 4's model (Llama4Family's model_class): transformers' tiled vision model and projector under Llama 4's decoder
(models/llama4_text.py), each picture's run its projected patches among its separators' own embeddings; the family
is in llama4.py.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from mmengine.layers.attention import AttentionMetadata
from mmengine.models.llama import DeepStack
from mmengine.models.llama4_text import Llama4DecoderModel
from mmengine.models.llava_model import normalize_llava_weight_name
from mmengine.models.vlm import VisionLanguageModel


class Llama4Model(VisionLanguageModel):
    """transformers' vision model and projector (the module names transformers gives them) and the decoder."""

    decoder_class = Llama4DecoderModel

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel

        self.config = config
        self.vision_model = Llama4VisionModel._from_config(config.vision_config, dtype=torch.get_default_dtype(),
                                                           attn_implementation="sdpa")
        self.multi_modal_projector = Llama4MultiModalProjector(config)
        self._build_text(config)
        self.image_token_id = config.image_token_id

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    def encoder_rows(self, item: dict[str, torch.Tensor]) -> int:
        return int(item["pixel_values"].shape[0])  # its tiles

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Pictures ({"pixel_values": [tiles, 3, S, S], "run_ids": the picture's text}) as one batch of tiles; one
        [len(run_ids), text hidden] run per picture: the projected patches at its <|patch|> tokens, the other
        tokens' own embeddings."""
        pixels = torch.cat([item["pixel_values"] for item in items]).to(self.device, self.vision_dtype)
        features = self.vision_model(pixels).last_hidden_state
        projected = self.multi_modal_projector(features.flatten(0, 1)).view(*features.shape[:2], -1)
        runs = []
        for item, tiles in zip(items, torch.split(projected, [self.encoder_rows(item) for item in items])):
            run_ids = item["run_ids"].to(self.device)
            run = self.embed_tokens(run_ids).to(tiles.dtype)
            run[run_ids == self.image_token_id] = tiles.flatten(0, 1)
            runs.append(run)
        return runs

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                deepstack: DeepStack | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, metadata)

    def checkpoint_name(self, raw_name: str) -> str:
        """The published `language_model.model.*` / `language_model.lm_head.weight` / `vision_model.*` /
        `multi_modal_projector.*` layout (transformers 5 saves it so too)."""
        return normalize_llava_weight_name(raw_name)
