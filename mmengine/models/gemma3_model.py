"""Gemma 3's model (Gemma3Family's model_class): transformers' SigLIP vision tower and Gemma 3's multimodal projector
under Gemma 3's decoder (models/gemma3_text.py); the family (pictures, pan-and-scan, soft tokens) is in gemma3.py.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.layers.attention import AttentionMetadata
from mmengine.models.gemma3 import check_pooling
from mmengine.models.gemma3_text import Gemma3DecoderModel
from mmengine.models.llama import DeepStack
from mmengine.models.vlm import VisionLanguageModel

SUPPORTED_VISION_MODEL_TYPES = ("siglip_vision_model",)
# (checkpoint prefixes, ours): transformers 5 saves the first, the published hub files the second
_VISION_PREFIXES = {
    "model.vision_tower.": "vision.vision_tower.", "vision_tower.": "vision.vision_tower.",
    "model.multi_modal_projector.": "vision.multi_modal_projector.", "multi_modal_projector.": "vision.multi_modal_projector.",
}
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
# Vision tensors known and not used: SigLIP's pooling head (vision_use_head; Gemma 3 reads the patch states)
_IGNORABLE_VISION_PREFIXES = ("vision.vision_tower.head.",)


class Gemma3VisionEncoder(nn.Module):
    """transformers' SigLIP vision model (without its pooling head) and Gemma3MultiModalProjector."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        from transformers import SiglipVisionModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        vision = config.vision_config
        if vision is None or vision.model_type not in SUPPORTED_VISION_MODEL_TYPES:
            raise UnsupportedModelError(f"vision tower {getattr(vision, 'model_type', None)!r} is not supported; "
                                        f"supported: {', '.join(SUPPORTED_VISION_MODEL_TYPES)}")
        check_pooling(config)
        vision = copy.deepcopy(vision)
        vision.vision_use_head = False
        # In the dtype being built (not the config's), with sdpa as transformers picks by default
        self.vision_tower = SiglipVisionModel._from_config(vision, dtype=torch.get_default_dtype(), attn_implementation="sdpa")
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.mm_input_projection_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.mm_input_projection_weight.device

    @torch.inference_mode()
    def encode(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Pictures ({"pixel_values": [3, S, S]}, all the tower's size) as one batch; one
        [mm_tokens_per_image, text hidden] tensor per picture, in order."""
        pixel_values = torch.stack([item["pixel_values"] for item in items])
        if self.device.type == "cuda":
            pixel_values = pixel_values.pin_memory()
        pixel_values = pixel_values.to(self.device, self.dtype, non_blocking=True)
        states = self.vision_tower(pixel_values=pixel_values).last_hidden_state
        return list(self.multi_modal_projector(states))


class Gemma3Model(VisionLanguageModel):
    language_model: Gemma3DecoderModel
    decoder_class = Gemma3DecoderModel

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = Gemma3VisionEncoder(config)
        self._build_text(config)
        self.image_token_id = config.image_token_id

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        return self.vision.encode(items)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A placeholder id outside the vocabulary embeds as the pad row (transformers' rule, before its item's
        embeddings are written over it); inside it (the releases) as its own row."""
        if self.image_token_id >= self.language_model.config.vocab_size:
            input_ids = torch.where(input_ids == self.image_token_id, 0, input_ids)
        return self.language_model.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                deepstack: DeepStack | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.softcap_logits(self.lm_head(hidden_states)).float()

    def checkpoint_name(self, raw_name: str) -> str:
        """transformers 5 saves `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`;
        the published files `language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`
        (lm_head tied, in both)."""
        if raw_name == "language_model.lm_head.weight":
            return "lm_head.weight"
        for prefix in _TEXT_PREFIXES:
            if raw_name.startswith(prefix):
                return "language_model." + raw_name.removeprefix(prefix)
        for prefix, ours in _VISION_PREFIXES.items():
            if raw_name.startswith(prefix):
                name = ours + raw_name.removeprefix(prefix)
                if name.startswith("vision.vision_tower.vision_model.") and not hasattr(self.vision.vision_tower, "vision_model"):
                    name = "vision.vision_tower." + name.removeprefix("vision.vision_tower.vision_model.")
                return name
        return raw_name

    def is_ignorable(self, name: str) -> bool:
        return name.startswith(_IGNORABLE_VISION_PREFIXES) or name == "vision.vision_tower.embeddings.position_ids" \
            or super().is_ignorable(name)
