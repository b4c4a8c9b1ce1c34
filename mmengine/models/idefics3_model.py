"""Idefics3's and SmolVLM2's model (their families' model_class): transformers' vision tower and pixel-shuffle
connector under the Llama decoder; the families (tiles, marker text) are in idefics3.py.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from mmengine.layers.attention import AttentionMetadata
from mmengine.models.idefics3 import check_idefics3_config
from mmengine.models.llama import DeepStack
from mmengine.models.vlm import VisionLanguageModel

# (checkpoint prefix, ours): transformers 5 and the published checkpoints alike
_PREFIXES = {"model.text_model.": "language_model.", "model.vision_model.": "vision_model.", "model.connector.": "connector."}


class Idefics3Model(VisionLanguageModel):
    """transformers' vision tower and connector (the module names transformers gives them) and the Llama decoder."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_idefics3_config(config)
        tower_class, connector_class = self.vision_classes()
        self.config = config
        # In the dtype being built (not the config's), with sdpa as transformers picks by default
        self.vision_model = tower_class._from_config(config.vision_config, dtype=torch.get_default_dtype(), attn_implementation="sdpa")
        self.connector = connector_class(config)
        self._build_text(config)
        self.image_token_id = config.image_token_id

    @staticmethod
    def vision_classes() -> tuple[type, type]:
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

        return Idefics3VisionTransformer, Idefics3Connector

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.vision_model.embeddings.patch_embedding.weight.dtype

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Tiles ({"pixel_values": [3, S, S]}, all the tile's size) as one batch; one [image_seq_len, text hidden]
        tensor per tile, in order."""
        pixel_values = torch.stack([item["pixel_values"] for item in items])
        if self.device.type == "cuda":
            pixel_values = pixel_values.pin_memory()
        pixel_values = pixel_values.to(self.device, self.vision_dtype, non_blocking=True)
        states = self.vision_model(pixel_values=pixel_values).last_hidden_state
        return list(self.connector(states))

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                deepstack: DeepStack | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, metadata)

    def checkpoint_name(self, raw_name: str) -> str:
        """`model.text_model.*`, `model.vision_model.*`, `model.connector.*`, `lm_head.weight` (tied in some)."""
        for prefix, ours in _PREFIXES.items():
            if raw_name.startswith(prefix):
                return ours + raw_name.removeprefix(prefix)
        return raw_name


class SmolVLMModel(Idefics3Model):
    @staticmethod
    def vision_classes() -> tuple[type, type]:
        from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

        return SmolVLMVisionTransformer, SmolVLMConnector
