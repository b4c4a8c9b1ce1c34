"""Gemma 4 (`Gemma4ForConditionalGeneration`): transformers' vision tower and embedder
(models/gemma4_vision.py) under Gemma 4's decoder (models/gemma4_text.py).

A picture becomes `<|image>`, one `<|image|>` per soft token (70 to 1120 by the processor's
max_soft_tokens and the picture's aspect ratio), `<image|>`; the soft tokens are the item. On the
sliding-window layers they attend to each other both ways (use_bidirectional_attention="vision"), so
the family asks that a prefill chunk holds a picture whole. Positions are plain 1-D. The audio tower
is built and loaded (the checkpoint's tensors are strict), audio inputs are not taken yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.layers.attention import AttentionMetadata
from mmengine.models.family import EncoderInputs, ModelFamily
from mmengine.models.gemma4_text import Gemma4DecoderModel, layer_attention
from mmengine.models.gemma4_vision import (
    VISION_CHECKPOINT_PREFIXES,
    Gemma4ImageItems,
    Gemma4VisionEncoder,
    buffers_to_parameters,
    load_gemma4_processor,
)
from mmengine.models.llama import DeepStack
from mmengine.models.vlm import VisionLanguageModel

_AUDIO_PREFIXES = {"model.audio_tower.": "audio_tower.", "model.embed_audio.": "embed_audio."}


class Gemma4Model(VisionLanguageModel):
    language_model: Gemma4DecoderModel
    decoder_class = Gemma4DecoderModel

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = Gemma4VisionEncoder(config)
        self.audio_tower = self.embed_audio = None
        if getattr(config, "audio_config", None) is not None:
            from transformers import AutoModel
            from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

            self.audio_tower = AutoModel.from_config(config.audio_config, dtype=torch.get_default_dtype())
            self.embed_audio = Gemma4MultimodalEmbedder(config.audio_config, config.text_config)
            buffers_to_parameters(self.audio_tower)
        self._build_text(config)
        placeholders = [getattr(config, name, None) for name in ("image_token_id", "video_token_id", "audio_token_id")]
        self.language_model.placeholder_ids = tuple(p for p in placeholders if p is not None)

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        return self.vision.encode(items)

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
        for prefixes, owner in ((VISION_CHECKPOINT_PREFIXES, "vision."), (_AUDIO_PREFIXES, "")):
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


class Gemma4Family(ModelFamily):
    architectures = ("Gemma4ForConditionalGeneration",)
    model_type = "gemma4"
    display_name = "Gemma 4 (sliding-window and global attention, pictures attended both ways)"
    model_class = Gemma4Model
    items_have_one_size = Gemma4ImageItems.items_have_one_size

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        self.images = Gemma4ImageItems(hf_config, self.image_processor_settings)

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        return load_gemma4_processor(model_dir, overrides)

    # -- text model --

    @property
    def head_dim(self) -> int:
        """The sliding layers' (the global layers' differ: kv_cache_layout has each)."""
        return layer_attention(self.text_config)[0].head_dim

    @property
    def sliding_window(self) -> int | None:
        return None  # windows are per layer, kept by the attention layers: no cap on max_model_len

    def kv_cache_layout(self) -> list[tuple[int, int]]:
        return [(layer.num_kv_heads, layer.head_dim) for layer in layer_attention(self.text_config) if layer.stores_kv]

    @property
    def num_attention_layers(self) -> int:
        return len(self.kv_cache_layout())

    @property
    def bidirectional_modalities(self) -> frozenset[str]:
        if getattr(self.text_config, "use_bidirectional_attention", None) == "vision":
            return frozenset({"image", "video"})
        return frozenset()

    # -- items --

    def image_prompt_ids(self, num_tokens: int) -> tuple[list[int], int]:
        return self.images.prompt_ids(num_tokens), 1

    def max_tokens_by_modality(self) -> dict[str, int]:
        return self.images.max_tokens_by_modality()

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None) -> str:
        return self.images.explain_max_tokens_per_item(limits)

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        return self.images.split_images(batch, num_images)

    def num_tokens(self, inputs: EncoderInputs) -> int:
        return self.images.num_tokens(inputs)

    def resized_size(self, height: int, width: int) -> tuple[int, int] | None:
        return self.images.resized_size(height, width)

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        return self.images.dummy_items(num_items)
