"""Gemma 4's model (Gemma4Family's model_class): transformers' vision tower and embedder (models/gemma4_vision.py) and
audio tower and embedder (models/gemma4_audio.py) under Gemma 4's decoder (models/gemma4_text.py); the family
(pictures, clips, the KV cache's layout) is in gemma4.py.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.layers.attention import AttentionMetadata
from mmengine.models.gemma4_audio import (
    AUDIO_CHECKPOINT_PREFIXES,
    Gemma4AudioEncoder,
)
from mmengine.models.gemma4_text import Gemma4DecoderModel
from mmengine.models.gemma4_vision import (
    VISION_CHECKPOINT_PREFIXES,
    Gemma4VisionEncoder,
)
from mmengine.models.llama import DeepStack
from mmengine.models.vlm import VisionLanguageModel


class Gemma4Model(VisionLanguageModel):
    language_model: Gemma4DecoderModel
    decoder_class = Gemma4DecoderModel

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = Gemma4VisionEncoder(config)
        self.audio = Gemma4AudioEncoder(config) if getattr(config, "audio_config", None) is not None else None
        self._build_text(config)
        placeholders = [getattr(config, name, None) for name in ("image_token_id", "video_token_id", "audio_token_id")]
        self.language_model.placeholder_ids = tuple(p for p in placeholders if p is not None)

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Pictures through the vision tower and clips through the audio tower (each kind as one batch);
        one output per item, in the order given."""
        audio = [i for i, item in enumerate(items) if "input_features" in item]
        if not audio:
            return self.vision.encode(items)
        if self.audio is None:
            raise RuntimeError("an audio item reached a Gemma 4 model without an audio tower")
        pictures = sorted(set(range(len(items))) - set(audio))
        outputs: list[torch.Tensor | None] = [None] * len(items)
        for indices, encoder in ((pictures, self.vision), (audio, self.audio)):
            if indices:
                for i, output in zip(indices, encoder.encode([items[i] for i in indices])):
                    outputs[i] = output
        return outputs  # type: ignore[return-value]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A placeholder embeds as the pad token (transformers' rule): an item's positions are then written over
        with its encoder output, and a placeholder with no item behind it (one the model generated) keeps the
        pad row, not its own."""
        return self.language_model.embed_tokens(self.language_model.text_ids(input_ids))

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                deepstack: DeepStack | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, metadata, deepstack, input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.softcap_logits(self.lm_head(hidden_states)).float()

    def vision_linears(self) -> dict[str, nn.Linear]:
        return {name: m for name, m in super().vision_linears().items() if name.startswith("vision.")}

    def checkpoint_name(self, raw_name: str) -> str:
        """The checkpoint saves `model.language_model.*`, `model.vision_tower.*`, `model.embed_vision.*`,
        `model.audio_tower.*`, `model.embed_audio.*` (lm_head is tied)."""
        if raw_name.startswith("model.language_model."):
            return "language_model." + raw_name.removeprefix("model.language_model.")
        for prefixes, owner in ((VISION_CHECKPOINT_PREFIXES, "vision."), (AUDIO_CHECKPOINT_PREFIXES, "audio.")):
            for prefix, ours in prefixes.items():
                if raw_name.startswith(prefix):
                    return owner + ours + raw_name.removeprefix(prefix)
        return raw_name

    def is_ignorable(self, name: str) -> bool:
        """Published E2B/E4B checkpoints still carry k/v projections and norms of their KV-shared layers."""
        parts = name.split(".")
        if len(parts) >= 5 and parts[0] == "language_model" and parts[1] == "layers" and parts[3] == "self_attn" \
                and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"):
            return not self.language_model.layer_attention[int(parts[2])].stores_kv
        return super().is_ignorable(name)
