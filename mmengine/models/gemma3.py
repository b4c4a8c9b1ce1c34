"""Gemma 3 (`Gemma3ForConditionalGeneration`): transformers' SigLIP vision tower and Gemma 3's multimodal
projector under Gemma 3's decoder (models/gemma3_text.py); the family here, the model in gemma3_model.py.

Every picture is resized to the tower's square input (896 px in the releases), its patch states
(post-layernormed) are average-pooled to `mm_tokens_per_image` (256) soft tokens, RMS-normed and
projected to the decoder's width. A prompt marks a picture `<start_of_image>`; Gemma3Processor writes
`\\n\\n<start_of_image>`, one `<image_soft_token>` per soft token, `<end_of_image>\\n\\n` in its place,
whose newlines tokenize together with the prompt's own, so the engine rewrites the marker's text before
tokenizing (ModelFamily.image_marker_text: the newlines around one soft token, which image_prompt_ids
expands into the run between `<start_of_image>` and `<end_of_image>`). The soft tokens are the item;
they attend to each other both ways on every layer, so a prefill chunk holds a picture whole. Positions
are plain 1-D.

With pan-and-scan (`do_pan_and_scan` in the checkpoint's image processor settings) a picture wide or
tall enough is also cut into 2 to `pan_and_scan_max_num_crops` crops, each resized to the tower's square:
the whole picture and each crop are items of their own (each its own encoder-cache entry and its own run
of soft tokens), and the marker becomes Gemma3Processor's "Here is the original image ... and here are
some crops to help you see better ..." text around their runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.models.family import EncoderInputs, ModelClass, ModelFamily, pil_image_processor
from mmengine.models.text_config import SLIDING

# Gemma3Processor's pan-and-scan settings (its images_kwargs beside do_convert_rgb)
PAN_AND_SCAN_SETTINGS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                         "pan_and_scan_min_ratio_to_activate")


def check_pooling(config: PretrainedConfig) -> None:
    """The projector pools the side of patches to the side of soft tokens: both must divide evenly."""
    vision, tokens = config.vision_config, config.mm_tokens_per_image
    patches, side = vision.image_size // vision.patch_size, int(round(tokens**0.5))
    if side * side != tokens or patches % side:
        raise UnsupportedModelError(f"mm_tokens_per_image {tokens} must be a square whose side divides the tower's "
                                    f"{patches}x{patches} patches")


class Gemma3Family(ModelFamily):
    architectures = ("Gemma3ForConditionalGeneration",)
    model_type = "gemma3"
    display_name = "Gemma 3 (SigLIP tower, sliding-window and global attention, pictures attended both ways)"
    model_class = ModelClass("mmengine.models.gemma3_model", "Gemma3Model")
    items_have_one_size = True  # every picture is resized to the tower's square

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        check_pooling(hf_config)

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """The checkpoint's Gemma3Processor with its pan-and-scan settings made one: transformers' processor
        hands the image processor its own defaults (pan-and-scan off) over the saved settings, while the
        engine calls the image processor alone, so the saved ones (else those defaults) are set on both."""
        processor = super().load_processor(model_dir, overrides)
        image_processor = _with_pan_and_scan_settings(processor.image_processor, type(processor).images_kwargs)
        processor.images_kwargs = {**type(processor).images_kwargs,
                                   **{name: getattr(image_processor, name) for name in PAN_AND_SCAN_SETTINGS}}
        return processor

    full_processor_reason = ""

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """Gemma3Processor's parts: the tokenizer, the PIL image processor with load_processor's pan-and-scan
        settings, the saved chat template, and its image marker (the tokenizer's <start_of_image>)."""
        from mmengine.multimodal.light_processor import LightProcessor, checkpoint_text_parts, unpickled_without_modeling_code

        tokenizer, saved = checkpoint_text_parts(model_dir)
        from transformers import Gemma3Processor

        image_processor = _with_pan_and_scan_settings(pil_image_processor(model_dir, overrides), Gemma3Processor.images_kwargs)
        return LightProcessor(tokenizer, unpickled_without_modeling_code(image_processor),
                              saved.get("chat_template"), tokenizer.boi_token)

    # -- text model --

    @property
    def sliding_window(self) -> int | None:
        return None  # windows are per layer, kept by the attention layers: no cap on max_model_len

    def kv_cache_windows(self) -> list[int | None]:
        window = self.text_config.sliding_window
        return [window if kind == SLIDING else None for kind in self.text_config.layer_types]

    @property
    def bidirectional_modalities(self) -> frozenset[str]:
        return frozenset({"image"})

    # -- items --

    def image_marker_text(self, processor: Any, picture: EncoderInputs) -> str | None:
        """Gemma3Processor's text for a picture (and its crops), one soft token standing for each item's run
        and the `<start_of_image>` / `<end_of_image>` around it (image_prompt_ids writes those: special
        tokens, they split the text alike whether there or not)."""
        num_items = len(self.image_items(picture))
        run = f"\n\n{processor.tokenizer.image_token}\n\n"
        if num_items == 1:
            return run
        return f"Here is the original image {run} and here are some crops to help you see better " + " ".join([run] * (num_items - 1))

    def image_items(self, inputs: EncoderInputs) -> list[EncoderInputs]:
        """The whole picture, then each pan-and-scan crop (none without pan-and-scan)."""
        if "crop_pixel_values" not in inputs:
            return [inputs]
        return [EncoderInputs(pixel_values=inputs["pixel_values"]), *(EncoderInputs(pixel_values=crop) for crop in inputs["crop_pixel_values"])]

    def image_prompt_ids(self, num_tokens: int) -> tuple[list[int], int]:
        """An item's run between `<start_of_image>` and `<end_of_image>`, as Gemma3Processor writes it (a token
        prompt's single placeholder is expanded so too)."""
        config = self.hf_config
        return [config.boi_token_id, *[config.image_token_id] * num_tokens, config.eoi_token_id], 1

    @property
    def tokens_per_image(self) -> int:
        return self.hf_config.mm_tokens_per_image

    def max_tokens_by_modality(self) -> dict[str, int]:
        return {"image": self.tokens_per_image}

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        vision = self.hf_config.vision_config
        side = vision.image_size // vision.patch_size
        return (f"every image resized to {vision.image_size}x{vision.image_size}, {side}x{side} patches of {vision.patch_size} px "
                f"average-pooled to mm_tokens_per_image {self.tokens_per_image}; every image the same")

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        """One entry per picture: its pixel values, and its pan-and-scan crops' (`crop_pixel_values`, where it
        has any; the processor's rows are each picture followed by its crops)."""
        pixel_values = batch["pixel_values"]
        num_crops = [int(n) for n in batch.get("num_crops", [0] * num_images)]
        if len(num_crops) != num_images or pixel_values.shape[0] != num_images + sum(num_crops):
            raise UnsupportedModelError(f"the image processor returned {pixel_values.shape[0]} images and crops "
                                        f"({num_crops}) for {num_images} images")
        if num_images == 1 and not num_crops[0]:  # its own tensor already: no copy
            return [EncoderInputs(pixel_values=pixel_values[0])]
        pictures, row = [], 0
        for crops in num_crops:
            picture = EncoderInputs(pixel_values=pixel_values[row].clone())
            if crops:
                picture["crop_pixel_values"] = pixel_values[row + 1:row + 1 + crops].clone()
            pictures.append(picture)
            row += 1 + crops
        return pictures

    def num_tokens(self, inputs: EncoderInputs) -> int:
        if "image_embeds" in inputs:
            return int(inputs["image_embeds"].shape[0])
        return self.tokens_per_image

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        size = self.hf_config.vision_config.image_size
        return [EncoderInputs(pixel_values=torch.zeros(3, size, size)) for _ in range(num_items)]


def _with_pan_and_scan_settings(image_processor: Any, defaults: Mapping[str, Any]) -> Any:
    """`image_processor` with each pan-and-scan setting it lacks set to Gemma3Processor's default (`defaults`)."""
    for name in PAN_AND_SCAN_SETTINGS:
        if getattr(image_processor, name, None) is None:
            setattr(image_processor, name, defaults[name])
    return image_processor
