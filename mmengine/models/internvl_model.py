"""InternVL's model (InternVLFamily's model_class): transformers' InternViT tower and pixel-shuffle projector under the
decoder; the family (448 px tiles plus a thumbnail) is in internvl.py.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from mmengine.layers.attention import AttentionMetadata
from mmengine.models.internvl import check_internvl_config
from mmengine.models.llama import DeepStack
from mmengine.models.llava_model import normalize_llava_weight_name
from mmengine.models.vlm import VisionLanguageModel


class InternVLModel(VisionLanguageModel):
    """transformers' InternViT tower and projector (the module names transformers gives them) and the decoder."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_internvl_config(config)
        from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector, InternVLVisionModel

        self.config = config
        # In the dtype being built (not the config's), with sdpa as transformers picks by default
        self.vision_tower = InternVLVisionModel._from_config(config.vision_config, dtype=torch.get_default_dtype(),
                                                             attn_implementation="sdpa")
        self.multi_modal_projector = InternVLMultiModalProjector(config)
        self._build_text(config)
        self.image_token_id = config.image_token_id

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.vision_tower.embeddings.patch_embeddings.projection.weight.dtype

    def encoder_rows(self, item: dict[str, torch.Tensor]) -> int:
        return int(item["pixel_values"].shape[0])

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Pictures ({"pixel_values": [tiles, 3, S, S]}) as one batch of tiles; one [tiles * image_seq_length,
        text hidden] run per picture, in order (transformers' InternVLModel.get_image_features)."""
        from transformers.models.internvl.modeling_internvl import InternVLModel as HFInternVLModel

        pixel_values = torch.cat([item["pixel_values"] for item in items])
        if self.device.type == "cuda":
            pixel_values = pixel_values.pin_memory()
        pixel_values = pixel_values.to(self.device, self.vision_dtype, non_blocking=True)
        states = self.vision_tower(pixel_values=pixel_values).last_hidden_state[:, 1:]  # CLS dropped
        side = int(states.shape[1] ** 0.5)
        states = states.reshape(states.shape[0], side, side, -1)
        # pixel_shuffle reads nothing from the model it is a method of
        states = HFInternVLModel.pixel_shuffle(None, states, scale_factor=self.config.downsample_ratio)
        features = self.multi_modal_projector(states.reshape(states.shape[0], -1, states.shape[-1]))
        return [run.flatten(0, 1) for run in torch.split(features, [self.encoder_rows(item) for item in items])]

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                deepstack: DeepStack | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, metadata)

    def checkpoint_name(self, raw_name: str) -> str:
        """transformers 5's `model.vision_tower.*` / `model.multi_modal_projector.*` / `model.language_model.*` /
        `lm_head.weight`, and the published `language_model.model.*` / `language_model.lm_head.weight`."""
        return normalize_llava_weight_name(raw_name)
