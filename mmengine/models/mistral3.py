"""Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2) and its Pixtral tower: transformers'
PixtralVisionModel (2-D RoPE at the picture's native resolution) and Mistral3's projector (RMS norm, the patch
merger of spatial_merge_size x spatial_merge_size patches, two linears) over the engine's Mistral decoder.

The image processor resizes a picture so that its longest edge fits `longest_edge` and both sides are multiples
of patch_size x spatial_merge_size (the processor sets that on the image processor; the engine does too). A
picture of R x C merged patches is written `[IMG]` x C then `[IMG_BREAK]` per row, the last row's break being
`[IMG_END]`. The whole run (breaks included) is the picture's one item and encoder-cache entry: its encoder output
holds the projected patches and, at the break and end positions, those tokens' own embeddings, as transformers'
model leaves them. Positions are plain 1-D.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from mmengine.errors import InvalidInputError, UnsupportedModelError
from mmengine.models.family import EncoderInputs, ModelClass, ModelFamily

BREAK, END = "[IMG_BREAK]", "[IMG_END]"


def check_mistral3_config(config: PretrainedConfig) -> None:
    if config.vision_feature_layer != -1:
        raise UnsupportedModelError(f"vision_feature_layer {config.vision_feature_layer} is not supported (the releases': -1)")


class Mistral3Family(ModelFamily):
    architectures = ("Mistral3ForConditionalGeneration",)
    model_type = "mistral3"
    display_name = "Mistral 3 (Pixtral tower at native resolution, 2-D RoPE, patch merger, Mistral decoder)"
    model_class = ModelClass("mmengine.models.mistral3_model", "Mistral3Model")
    full_processor_reason = ""

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """load_processor's PixtralPromptProcessor (the engine's own, not transformers' processor class), its image
        processor loaded after transformers' processing code alone and pickled for workers the same way."""
        from mmengine.multimodal.light_processor import import_processing_code, unpickled_without_modeling_code

        import_processing_code()
        processor = cls.load_processor(model_dir, overrides)
        unpickled_without_modeling_code(processor.image_processor)
        return processor

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        check_mistral3_config(hf_config)
        self.merged_patch = hf_config.vision_config.patch_size * hf_config.spatial_merge_size
        size = self.image_processor_settings.get("size") or {}
        self.longest_edge = int(size.get("longest_edge") or hf_config.vision_config.image_size)
        patch = self.image_processor_settings.get("patch_size")
        if isinstance(patch, Mapping) and (patch.get("height"), patch.get("width")) != (self.merged_patch,) * 2:
            raise UnsupportedModelError(f"the image processor's patch_size {dict(patch)} is not the merged patch "
                                        f"({self.merged_patch} px) the model's tokens are counted in")
        self._marker_ids: list[int] | None = None

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """PixtralPromptProcessor over the PIL image processor (transformers' PixtralProcessor needs torchvision),
        whose patch_size is set to the merged patch as PixtralProcessor sets it for each call."""
        from transformers import AutoTokenizer, PixtralImageProcessorPil

        path = Path(model_dir) / "processor_config.json"
        saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        merged = int(saved.get("patch_size", 16)) * int(saved.get("spatial_merge_size", 1))
        image_processor = PixtralImageProcessorPil.from_pretrained(
            model_dir, local_files_only=True, **{**overrides, "patch_size": {"height": merged, "width": merged}})
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        template_path = Path(model_dir) / "chat_template.json"
        template = json.loads(template_path.read_text(encoding="utf-8")).get("chat_template") if template_path.is_file() else None
        return PixtralPromptProcessor(image_processor, tokenizer, template or tokenizer.chat_template, merged,
                                      saved.get("image_token", "[IMG]"), saved.get("image_break_token", BREAK),
                                      saved.get("image_end_token", END))

    # -- items --

    def grid(self, inputs: EncoderInputs) -> tuple[int, int]:
        if "image_embeds" in inputs:
            raise InvalidInputError("Mistral 3 takes no precomputed image_embeds: a picture's run needs its grid of rows")
        height, width = inputs["pixel_values"].shape[-2:]
        return int(height) // self.merged_patch, int(width) // self.merged_patch

    @property
    def max_side(self) -> int:
        return self.longest_edge // self.merged_patch

    def max_tokens_by_modality(self) -> dict[str, int]:
        return {"image": self.max_side * (self.max_side + 1)}

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        return (f"pictures resized to a longest edge of at most {self.longest_edge} px in {self.merged_patch} px merged "
                f"patches: up to {self.max_side}x{self.max_side} [IMG] tokens and a break per row, at most "
                f"{self.max_tokens_by_modality()['image']}")

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        """One entry per picture: its pixels cropped from the padded batch to its resized size."""
        pixel_values, sizes = batch["pixel_values"], [tuple(int(v) for v in s) for s in batch["image_sizes"]]
        if len(sizes) != num_images or pixel_values.shape[0] != num_images:
            raise UnsupportedModelError(f"the image processor returned {pixel_values.shape[0]} images for {num_images}")
        markers = torch.tensor(self.marker_ids)
        return [EncoderInputs(pixel_values=pixel_values[k, :, :h, :w].clone(), marker_ids=markers.clone())
                for k, (h, w) in enumerate(sizes)]

    def num_tokens(self, inputs: EncoderInputs) -> int:
        rows, cols = self.grid(inputs)
        return rows * (cols + 1)

    def image_run_ids(self, inputs: EncoderInputs) -> tuple[list[int], int]:
        """[IMG] x cols and [IMG_BREAK] per row, the last break [IMG_END] (PixtralProcessor.replace_image_token)."""
        rows, cols = self.grid(inputs)
        breaks, end = self.marker_ids
        run = ([self.image_token_id] * cols + [breaks]) * rows
        run[-1] = end
        return run, 0

    @property
    def marker_ids(self) -> list[int]:
        """The ids of [IMG_BREAK] and [IMG_END], from the checkpoint's tokenizer files."""
        if self._marker_ids is None:
            self._marker_ids = _token_ids(self.model_dir, (BREAK, END))
        return self._marker_ids

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

        return get_resize_output_image_size(np.zeros((height, width, 1), dtype=np.uint8), size=self.longest_edge,
                                            patch_size=self.merged_patch)

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        side = self.max_side * self.merged_patch
        return [EncoderInputs(pixel_values=torch.zeros(3, side, side), marker_ids=torch.tensor(self.marker_ids))
                for _ in range(num_items)]


class PixtralPromptProcessor:
    """PixtralProcessor's text-and-image half without torchvision: each `[IMG]` marker becomes its picture's rows
    (PixtralProcessor.replace_image_token), the pictures are the PIL image processor's."""

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None, merged_patch: int,
                 image_token: str, image_break_token: str, image_end_token: str) -> None:
        self.image_processor, self.tokenizer, self.chat_template = image_processor, tokenizer, chat_template
        self.merged_patch = merged_patch
        self.image_token, self.image_break_token, self.image_end_token = image_token, image_break_token, image_end_token

    def expand(self, text: str, image_sizes: Any) -> str:
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(image_sizes):
            raise InvalidInputError(f"the text has {len(pieces) - 1} {self.image_token} marker(s) but "
                                    f"{len(image_sizes)} image(s) were given")
        out = pieces[0]
        for (height, width), piece in zip(image_sizes, pieces[1:]):
            rows, cols = int(height) // self.merged_patch, int(width) // self.merged_patch
            run = ((self.image_token * cols) + self.image_break_token) * rows
            out += run[: -len(self.image_break_token)] + self.image_end_token + piece
        return out

    def __call__(self, text: str | list[str], images: Any = None, return_tensors: str | None = None, **kwargs: Any) -> Any:
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        data: dict[str, Any] = {}
        if images:
            data = dict(self.image_processor(images, return_tensors=return_tensors))
            sizes, expanded = list(data["image_sizes"]), []
            if sum(t.count(self.image_token) for t in texts) != len(sizes):
                raise InvalidInputError(f"the text has {sum(t.count(self.image_token) for t in texts)} {self.image_token} "
                                        f"marker(s) but {len(sizes)} image(s) were given")
            for t in texts:
                count = t.count(self.image_token)
                expanded.append(self.expand(t, sizes[:count]))
                sizes = sizes[count:]
            texts = expanded
        data.update(self.tokenizer(texts, return_tensors=return_tensors, **kwargs))
        return BatchFeature(data, tensor_type=return_tensors)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(conversation, **kwargs)


def _token_ids(model_dir: str | None, names: tuple[str, ...]) -> list[int]:
    """Ids of added tokens from tokenizer.json / tokenizer_config.json, without loading the tokenizer."""
    if model_dir is None:
        raise UnsupportedModelError("Mistral 3 needs its checkpoint directory to read the [IMG_BREAK] / [IMG_END] ids")
    directory, ids = Path(model_dir), {}
    if (directory / "tokenizer.json").is_file():
        tokenizer = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = tokenizer.get("model", {}).get("vocab")
        if isinstance(vocab, dict):  # BPE vocabularies are a dict; the control tokens may be plain entries
            ids.update({name: int(vocab[name]) for name in names if name in vocab})
        ids.update({token["content"]: int(token["id"]) for token in tokenizer.get("added_tokens", [])})
    if (directory / "tokenizer_config.json").is_file():
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        ids.update({entry["content"]: int(key) for key, entry in (config.get("added_tokens_decoder") or {}).items()})
    missing = [name for name in names if name not in ids]
    if missing:
        raise UnsupportedModelError(f"the tokenizer has no {' / '.join(missing)} token")
    return [ids[name] for name in names]
