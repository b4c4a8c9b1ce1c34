"""LLaVA-1.5-style VLM: a vision tower, a multi-modal projector and a Llama-family decoder; the family (what front
ends and preprocessing workers import: processor, items, token counts) here, its model in llava_model.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mmengine.errors import UnsupportedModelError
from mmengine.models.family import EncoderInputs, ModelClass, ModelFamily, pil_image_processor


class LlavaFamily(ModelFamily):
    """LLaVA-1.5: every image is resized to the tower's square input and yields the same number of
    embeddings (one per patch, plus CLS when the selection keeps it)."""

    architectures = ("LlavaForConditionalGeneration",)
    model_type = "llava"
    items_have_one_size = True
    display_name = "LLaVA-1.5 (CLIP or SigLIP tower, Llama/Mistral/Qwen2 decoder)"
    model_class = ModelClass("mmengine.models.llava_model", "LlavaModel")
    full_processor_reason = ""

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """LlavaProcessor's parts: the tokenizer, the PIL image processor, the saved chat template and image token."""
        from mmengine.multimodal.light_processor import (
            LightProcessor, checkpoint_text_parts, special_token, unpickled_without_modeling_code,
        )

        tokenizer, saved = checkpoint_text_parts(model_dir)
        image_processor = unpickled_without_modeling_code(pil_image_processor(model_dir, overrides))
        return LightProcessor(tokenizer, image_processor, saved.get("chat_template"),
                              special_token(tokenizer, "image_token", saved.get("image_token", "<image>")))

    def max_tokens_by_modality(self) -> dict[str, int]:
        return {"image": self._tokens_per_image()}

    def _tokens_per_image(self) -> int:
        vision = self.hf_config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        has_cls = vision.model_type == "clip_vision_model"
        strategy = self.hf_config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
        return patches + int(has_cls) - int(strategy == "default")

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        vision = self.hf_config.vision_config
        side = vision.image_size // vision.patch_size
        parts = [f"{vision.model_type}: image_size {vision.image_size} / patch_size {vision.patch_size} = {side}x{side} patches"]
        if vision.model_type == "clip_vision_model":
            parts.append("+1 CLS")
        if self.hf_config.vision_feature_select_strategy == "default":
            parts.append("-1 (vision_feature_select_strategy 'default' drops the first token)")
        return ", ".join(parts) + "; every image the same"

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        pixel_values = batch["pixel_values"]
        if num_images == 1:  # its own tensor already: no copy
            return [EncoderInputs(pixel_values=pixel_values[0])]
        return [EncoderInputs(pixel_values=pixel_values[i].clone()) for i in range(num_images)]

    def num_tokens(self, inputs: EncoderInputs) -> int:
        return self._tokens_per_image()

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        size = self.hf_config.vision_config.image_size
        return [EncoderInputs(pixel_values=torch.zeros(3, size, size)) for _ in range(num_items)]


