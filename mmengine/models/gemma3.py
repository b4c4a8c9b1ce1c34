"""Gemma 3 (`Gemma3ForConditionalGeneration`): transformers' SigLIP vision tower and Gemma 3's multimodal
projector under Gemma 3's decoder (models/gemma3_text.py).

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

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.layers.attention import AttentionMetadata
from mmengine.models.family import EncoderInputs, ModelFamily, pil_image_processor
from mmengine.models.gemma3_text import SLIDING, Gemma3DecoderModel
from mmengine.models.llama import DeepStack
from mmengine.models.vlm import VisionLanguageModel

SUPPORTED_VISION_MODEL_TYPES = ("siglip_vision_model",)
# (checkpoint prefixes, ours): transformers 5 saves the first, the published hub files the second
_VISION_PREFIXES = {
    "model.vision_tower.": "vision.vision_tower.", "vision_tower.": "vision.vision_tower.",
    "model.multi_modal_projector.": "vision.multi_modal_projector.", "multi_modal_projector.": "vision.multi_modal_projector.",
}
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
# Gemma3Processor's pan-and-scan settings (its images_kwargs beside do_convert_rgb)
PAN_AND_SCAN_SETTINGS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                         "pan_and_scan_min_ratio_to_activate")
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


def check_pooling(config: PretrainedConfig) -> None:
    """The projector pools the side of patches to the side of soft tokens: both must divide evenly."""
    vision, tokens = config.vision_config, config.mm_tokens_per_image
    patches, side = vision.image_size // vision.patch_size, int(round(tokens**0.5))
    if side * side != tokens or patches % side:
        raise UnsupportedModelError(f"mm_tokens_per_image {tokens} must be a square whose side divides the tower's "
                                    f"{patches}x{patches} patches")


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


class Gemma3Family(ModelFamily):
    architectures = ("Gemma3ForConditionalGeneration",)
    model_type = "gemma3"
    display_name = "Gemma 3 (SigLIP tower, sliding-window and global attention, pictures attended both ways)"
    model_class = Gemma3Model
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
        from mmengine.multimodal.light_processor import (
            LightProcessor, import_processing_code, saved_processor_settings, unpickled_without_modeling_code,
        )

        import_processing_code()
        from transformers import AutoTokenizer, Gemma3Processor

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        image_processor = _with_pan_and_scan_settings(pil_image_processor(model_dir, overrides), Gemma3Processor.images_kwargs)
        return LightProcessor(tokenizer, unpickled_without_modeling_code(image_processor),
                              saved_processor_settings(model_dir).get("chat_template"), tokenizer.boi_token)

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
