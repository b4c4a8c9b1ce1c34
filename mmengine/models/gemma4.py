"""Gemma 4 (`Gemma4ForConditionalGeneration`): transformers' vision tower and embedder
(models/gemma4_vision.py) and audio tower and embedder (models/gemma4_audio.py) under Gemma 4's
decoder (models/gemma4_text.py); the family here, the model in gemma4_model.py.

A picture becomes `<|image>`, one `<|image|>` per soft token (70 to 1120 by the processor's
max_soft_tokens and the picture's aspect ratio), `<image|>`; the soft tokens are the item. On the
sliding-window layers they attend to each other both ways (use_bidirectional_attention="vision"), so
the family asks that a prefill chunk holds a picture whole. An audio clip becomes `<|audio>`, one
`<|audio|>` per 40 ms (at most 750), `<audio|>`; its soft tokens attend causally, as text does.
Positions are plain 1-D.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.models.family import AudioFormat, EncoderInputs, ModelClass, ModelFamily
from mmengine.models.gemma4_audio import (
    Gemma4AudioItems,
    load_gemma4_feature_extractor,
    saved_audio_seq_length,
)
from mmengine.models.gemma4_layers import layer_attention
from mmengine.models.gemma4_vision import (
    Gemma4ImageItems,
    load_gemma4_light_processor,
    load_gemma4_processor,
)
from mmengine.models.text_config import SLIDING


class Gemma4Family(ModelFamily):
    architectures = ("Gemma4ForConditionalGeneration",)
    model_type = "gemma4"
    display_name = "Gemma 4 (sliding-window and global attention, pictures attended both ways)"
    model_class = ModelClass("mmengine.models.gemma4_model", "Gemma4Model")
    items_have_one_size = Gemma4ImageItems.items_have_one_size  # pictures; clips are as long as they are

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        self.images = Gemma4ImageItems(hf_config, self.image_processor_settings)
        self.audios: Gemma4AudioItems | None = None
        if getattr(hf_config, "audio_config", None) is not None:
            self.audios = Gemma4AudioItems(hf_config, load_gemma4_feature_extractor(model_dir), saved_audio_seq_length(model_dir))

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        return load_gemma4_processor(model_dir, overrides)

    full_processor_reason = ""

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        return load_gemma4_light_processor(model_dir, overrides)

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

    def kv_cache_windows(self) -> list[int | None]:
        window = self.text_config.sliding_window
        return [window if layer.kind == SLIDING else None for layer in layer_attention(self.text_config) if layer.stores_kv]

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
        sizes = self.images.max_tokens_by_modality()
        if self.audios is not None:
            sizes["audio"] = self.audios.max_tokens
        return sizes

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        text = self.images.explain_max_tokens_per_item(limits)
        if self.audios is None:
            return text
        if limits is not None and limits.get("audio", 0) == 0:
            return f"{text}; audio not allowed by limit_mm_per_prompt: not counted"
        audio = self.audios.explain()
        if max_audio_seconds is not None and max_audio_seconds < self.audios.format.max_seconds:
            tokens = self.audio_num_tokens(int(max_audio_seconds * self.audios.format.sampling_rate))
            audio += f", {tokens} within max_audio_seconds={max_audio_seconds:g}"
        return f"{text}; {audio}"

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        return self.images.split_images(batch, num_images)

    def num_tokens(self, inputs: EncoderInputs) -> int:
        if "input_features" in inputs:
            return self._audios().num_tokens(inputs)
        return self.images.num_tokens(inputs)

    def resized_size(self, height: int, width: int) -> tuple[int, int] | None:
        return self.images.resized_size(height, width)

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        return self.images.dummy_items(num_items)

    def dummy_audio_items(self, num_items: int, max_audio_seconds: float) -> list[EncoderInputs]:
        if self.audios is None or num_items < 1:
            return []
        audio_format = self.audios.format
        samples = min(audio_format.max_samples, int(max_audio_seconds * audio_format.sampling_rate))
        return [self.audios.item(np.zeros(samples, dtype=np.float32))] * num_items

    # -- audio --

    @property
    def audio_token_id(self) -> int | None:
        return None if self.audios is None else self.audios.audio_token_id

    @property
    def audio_format(self) -> AudioFormat | None:
        return None if self.audios is None else self.audios.format

    def audio_prompt_ids(self, num_tokens: int) -> tuple[list[int], int]:
        return self._audios().prompt_ids(num_tokens), 1

    def audio_item(self, waveform: Any) -> EncoderInputs:
        return self._audios().item(waveform)

    def audio_num_tokens(self, num_samples: int) -> int:
        return self._audios().num_tokens_of_samples(num_samples)

    def _audios(self) -> Gemma4AudioItems:
        if self.audios is None:
            raise UnsupportedModelError("this Gemma 4 checkpoint has no audio tower (audio_config is null)")
        return self.audios
