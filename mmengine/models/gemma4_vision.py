"""Gemma 4's image side: the processor (without torchvision), the vision encoder and the image items.

An image is resized keeping its aspect ratio to the most pixels that make at most `max_soft_tokens`
x k^2 patches of `patch_size` px with both sides multiples of k x `patch_size` (k = the pooling
kernel, 3), cut into patches and padded to `max_soft_tokens` x k^2 rows (padding at position -1).
transformers' vision tower (bidirectional attention over the real patches, 2-D RoPE) pools each k x k
block into one soft token, and the multimodal embedder (an RMSNorm without weight, a linear layer)
projects it to the decoder's width. In the prompt an image is `<|image>` + `<|image|>` x soft tokens
+ `<image|>`: only the `<|image|>` run takes the image's embeddings (mm_token_type_ids 1); the two
tokens around it are text.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.models.family import EncoderInputs

# Checkpoint tensor prefix -> Gemma4VisionEncoder's own prefix (the rest of the name is kept).
VISION_CHECKPOINT_PREFIXES: dict[str, str] = {
    "model.vision_tower.": "vision_tower.",
    "model.embed_vision.": "embed_vision.",
}

# The values Gemma4ImageProcessor accepts for max_soft_tokens.
SUPPORTED_MAX_SOFT_TOKENS = (70, 140, 280, 560, 1120)


def vision_checkpoint_name(raw_name: str) -> str | None:
    """The encoder's name for a checkpoint tensor of the vision side, or None for any other tensor."""
    for prefix, ours in VISION_CHECKPOINT_PREFIXES.items():
        if raw_name.startswith(prefix):
            return ours + raw_name.removeprefix(prefix)
    return None


# -- processor ------------------------------------------------------------------------------------


@functools.cache
def processor_without_video_class() -> type:
    """transformers' Gemma4Processor without its torchvision-only video processor.

    transformers reads a processor's parts from its __init__ signature, so the subclass's signature
    leaves video_processor out; Gemma4Processor.__init__ still passes video_processor=None on to
    ProcessorMixin.__init__, which would reject it, so a mixin placed between them in the MRO drops it.
    """
    from transformers import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    class DropVideoProcessor(ProcessorMixin):
        def __init__(self, *args: Any, video_processor: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    class Gemma4ProcessorWithoutVideo(Gemma4Processor, DropVideoProcessor):
        # (the settings are named, not left in **kwargs: save_pretrained writes the named ones only)
        def __init__(self, feature_extractor=None, image_processor=None, tokenizer=None, chat_template=None,
                     image_seq_length=280, audio_seq_length=750, audio_ms_per_token=40, **kwargs):
            super().__init__(feature_extractor, image_processor, tokenizer, None, chat_template=chat_template,
                             image_seq_length=image_seq_length, audio_seq_length=audio_seq_length,
                             audio_ms_per_token=audio_ms_per_token, **kwargs)

    return Gemma4ProcessorWithoutVideo


# Gemma4Processor's own settings in processor_config.json (beside its parts' nested settings).
_PROCESSOR_SETTINGS = ("image_seq_length", "audio_seq_length", "audio_ms_per_token")


def load_gemma4_processor(model_dir: str, overrides: Mapping[str, Any]) -> Any:
    """The checkpoint's Gemma4Processor (tokenizer, Gemma4ImageProcessorPil, audio feature extractor,
    chat template) without a video processor, so it loads with or without torchvision; `overrides`
    (e.g. max_soft_tokens) replace the image processor's saved settings."""
    tokenizer, image_processor, feature_extractor = _gemma4_parts(model_dir, overrides)
    config_path = Path(model_dir) / "processor_config.json"
    saved = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    settings = {name: saved[name] for name in _PROCESSOR_SETTINGS if name in saved}
    return processor_without_video_class()(
        feature_extractor, image_processor, tokenizer, chat_template=tokenizer.chat_template, **settings
    )


def load_gemma4_light_processor(model_dir: str, overrides: Mapping[str, Any]) -> Any:
    """load_gemma4_processor's parts as a LightProcessor, with the tokens Gemma4Processor takes (and the video
    token it adds to the tokenizer), loaded after transformers' processing code alone."""
    from mmengine.multimodal.light_processor import LightProcessor, import_processing_code, unpickled_without_modeling_code

    import_processing_code()
    tokenizer, image_processor, feature_extractor = _gemma4_parts(model_dir, overrides)
    tokenizer.add_special_tokens({"additional_special_tokens": [_VIDEO]})  # as Gemma4Processor.__init__
    return LightProcessor(tokenizer, unpickled_without_modeling_code(image_processor), tokenizer.chat_template,
                          tokenizer.image_token, _VIDEO, audio_token=getattr(tokenizer, "audio_token", None),
                          feature_extractor=feature_extractor)


_VIDEO = "<|video|>"  # Gemma4Processor's video token


def _gemma4_parts(model_dir: str, overrides: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """The tokenizer, the PIL image processor (with `overrides`) and the audio feature extractor."""
    from transformers import AutoTokenizer, Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    image_processor = Gemma4ImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **dict(overrides))
    try:
        feature_extractor = Gemma4AudioFeatureExtractor.from_pretrained(model_dir, local_files_only=True)
    except OSError:  # a checkpoint without audio settings: Gemma4Processor still wants the part (unused)
        feature_extractor = Gemma4AudioFeatureExtractor()
    return tokenizer, image_processor, feature_extractor


# -- encoder --------------------------------------------------------------------------------------


class Gemma4VisionEncoder(nn.Module):
    """transformers' Gemma 4 vision tower and multimodal embedder, named as in the checkpoint (see
    VISION_CHECKPOINT_PREFIXES). The tower's persistent buffers (clipped linears' bounds,
    standardization) are made parameters, so that a loader filling parameters fills them too."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

        if config.vision_config is None:
            raise UnsupportedModelError("this Gemma 4 checkpoint has no vision tower (vision_config is null)")
        # In the dtype being built (not the config's), with sdpa as transformers picks by default
        self.vision_tower = Gemma4VisionModel._from_config(
            config.vision_config, dtype=torch.get_default_dtype(), attn_implementation="sdpa"
        )
        self.embed_vision = Gemma4MultimodalEmbedder(config.vision_config, config.text_config)
        self.pooling_kernel_size = config.vision_config.pooling_kernel_size
        buffers_to_parameters(self.vision_tower)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_vision.embedding_projection.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_vision.embedding_projection.weight.device

    @torch.inference_mode()
    def encode(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Images (each {"pixel_values": [patches, 3 * ps^2], "image_position_ids": [patches, 2]}, padding
        rows at position -1, all with the same number of rows) through the tower as one batch; one
        [soft tokens, text hidden] tensor per image, in order."""
        pixel_values = torch.stack([item["pixel_values"] for item in items])
        positions = torch.stack([item["image_position_ids"] for item in items])
        if self.device.type == "cuda":
            pixel_values, positions = pixel_values.pin_memory(), positions.pin_memory()
        pixel_values = pixel_values.to(self.device, self.dtype, non_blocking=True)
        positions = positions.to(self.device, non_blocking=True)
        # The tower returns the real soft tokens of every image, concatenated in image order
        features = self.vision_tower(pixel_values=pixel_values, pixel_position_ids=positions).last_hidden_state
        embeddings = self.embed_vision(features)
        return list(torch.split(embeddings, soft_token_counts(positions, self.pooling_kernel_size)))


def soft_token_counts(positions: torch.Tensor, pooling_kernel_size: int) -> list[int]:
    """Soft tokens of each image in a [images, patches, 2] batch of patch positions (padding at -1)."""
    real = (positions != -1).all(dim=-1).sum(dim=-1)
    return (real // pooling_kernel_size**2).tolist()


def buffers_to_parameters(module: nn.Module) -> None:
    """Each persistent buffer of `module` becomes a parameter (no gradient) of the same name."""
    parameters = {name for name, _ in module.named_parameters()}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name in parameters:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        delattr(owner, attr)
        owner.register_parameter(attr, nn.Parameter(tensor, requires_grad=False))


# -- items ----------------------------------------------------------------------------------------


class Gemma4ImageItems:
    """What a family needs to know of Gemma 4's images: items, their token counts, the largest one,
    the resize rule, and the tokens around an image's soft tokens in the prompt."""

    # Every item has max_patches rows (the processor pads them), dummy_items' size.
    items_have_one_size = True

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: Mapping[str, Any]) -> None:
        """`image_processor_settings`: the loaded image processor's max_soft_tokens, pooling_kernel_size
        and patch_size (the last defaults to the tower's). No default for the others: the processor
        always has them, and a wrong guess would size the encoder budget wrongly."""
        settings = dict(image_processor_settings)
        missing = [name for name in ("max_soft_tokens", "pooling_kernel_size") if settings.get(name) is None]
        if missing:
            raise ValueError(f"Gemma 4's image settings need the image processor's {' and '.join(missing)}")
        vision = hf_config.vision_config
        if vision is None:
            raise UnsupportedModelError("this Gemma 4 checkpoint has no vision tower (vision_config is null)")
        self.hf_config = hf_config
        self.patch_size = int(settings.get("patch_size") or vision.patch_size)
        self.pooling_kernel_size = int(settings["pooling_kernel_size"])
        self.max_soft_tokens = int(settings["max_soft_tokens"])
        if (self.patch_size, self.pooling_kernel_size) != (vision.patch_size, vision.pooling_kernel_size):
            raise UnsupportedModelError(
                f"the image processor's patch_size {self.patch_size} / pooling_kernel_size {self.pooling_kernel_size} "
                f"differ from the vision tower's {vision.patch_size} / {vision.pooling_kernel_size}"
            )
        if self.max_soft_tokens not in SUPPORTED_MAX_SOFT_TOKENS:
            raise UnsupportedModelError(
                f"max_soft_tokens {self.max_soft_tokens} is not supported; Gemma 4 takes one of {SUPPORTED_MAX_SOFT_TOKENS}"
            )

    @classmethod
    def from_image_processor(cls, hf_config: PretrainedConfig, image_processor: Any) -> Gemma4ImageItems:
        names = ("patch_size", "pooling_kernel_size", "max_soft_tokens")
        return cls(hf_config, {name: getattr(image_processor, name, None) for name in names})

    # -- prompt tokens --

    @property
    def image_token_id(self) -> int:
        """`<|image|>`: one per soft token, each replaced by the image's embedding."""
        return self.hf_config.image_token_id

    @property
    def boi_token_id(self) -> int:
        """`<|image>`, the text token before an image's soft tokens."""
        return self.hf_config.boi_token_id

    @property
    def eoi_token_id(self) -> int:
        """`<image|>`, the text token after an image's soft tokens."""
        return self.hf_config.eoi_token_id

    def prompt_ids(self, num_tokens: int) -> list[int]:
        """The ids an image's `<|image|>` marker becomes in the prompt (as Gemma4Processor expands it)."""
        return [self.boi_token_id, *[self.image_token_id] * num_tokens, self.eoi_token_id]

    # -- items --

    @property
    def max_patches(self) -> int:
        """Rows of every item: the patches of the largest image (smaller ones are padded)."""
        return self.max_soft_tokens * self.pooling_kernel_size**2

    def split_images(self, batch: Mapping[str, Any], num_images: int) -> list[EncoderInputs]:
        """The image processor's output for `num_images` images, one item per image, in order."""
        pixel_values, positions = batch["pixel_values"], batch["image_position_ids"]
        if pixel_values.shape[0] != num_images or positions.shape[0] != num_images:
            raise UnsupportedModelError(
                f"the image processor returned {pixel_values.shape[0]} images for {num_images}"
            )
        if num_images == 1:  # its own tensors already: no copy
            return [EncoderInputs(pixel_values=pixel_values[0], image_position_ids=positions[0])]
        return [
            EncoderInputs(pixel_values=pixel_values[i].clone(), image_position_ids=positions[i].clone())
            for i in range(num_images)
        ]

    def num_tokens(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Soft tokens of an item: its real patches over k^2 (or its rows, for precomputed embeddings)."""
        if "image_embeds" in inputs:
            return int(inputs["image_embeds"].shape[0])
        return soft_token_counts(inputs["image_position_ids"][None], self.pooling_kernel_size)[0]

    def max_tokens_by_modality(self) -> dict[str, int]:
        """The resize never makes more than max_soft_tokens (transformers raises rather than exceed it),
        and an image of the right aspect ratio makes exactly that many."""
        return {"image": self.max_soft_tokens}

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None) -> str:
        k, ps = self.pooling_kernel_size, self.patch_size
        return (
            f"images resized (aspect ratio kept) to at most max_soft_tokens {self.max_soft_tokens} x {k}x{k} patches of "
            f"{ps} px, sides multiples of {k * ps} px, one embedding per {k}x{k} patches: at most {self.max_soft_tokens}"
        )

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) Gemma4ImageProcessor resizes an image to (transformers' own rule)."""
        from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

        return get_aspect_ratio_preserving_size(height, width, self.patch_size, self.max_patches, self.pooling_kernel_size)

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        """Items of max_soft_tokens soft tokens each: the most nearly square grid of that many k x k blocks,
        every row a real patch (the tower's cost is the same for every item; this one has no padding)."""
        k = self.pooling_kernel_size
        rows = max(r for r in range(1, math.isqrt(self.max_soft_tokens) + 1) if self.max_soft_tokens % r == 0)
        height, width = rows * k, self.max_soft_tokens // rows * k
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        positions = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
        pixels = torch.zeros(self.max_patches, 3 * self.patch_size**2)
        return [EncoderInputs(pixel_values=pixels, image_position_ids=positions) for _ in range(num_items)]
