"""Random-weight InternVL 3.5 (`InternVLForConditionalGeneration`) checkpoints for tests.

Built locally with transformers' own classes (InternVLConfig over an InternVLVisionConfig and a Qwen3 text
config, the PIL `GotOcr2ImageProcessorPil`, `InternVLProcessor`) and a locally trained tokenizer with Qwen's
special tokens plus `<img>`, `</img>`, `<IMG_CONTEXT>` and `<video>` (named as the published tokenizer names
them: start_image_token, end_image_token, context_image_token, video_token); laid out as the published
OpenGVLab/InternVL3_5-*-HF checkpoints are: config.json, model.safetensors, the tokenizer files,
preprocessor_config.json (the image processor), processor_config.json (image_seq_length) and
chat_template.json. transformers reloads the model with `InternVLForConditionalGeneration.from_pretrained`.

The default spec tiles pictures into 32 px tiles of 4x4 patches, pixel-shuffled by 0.5 to 4 tokens a tile,
between 1 and 6 tiles a picture plus the thumbnail when there is more than one.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmengine.testing.checkpoint import save_processor_files, text_config_args, vision_sizes
from mmengine.testing.family_builder import FamilyBuilder
from mmengine.testing.tokenizer import tiny_tokenizer

if TYPE_CHECKING:
    from transformers import InternVLConfig, PreTrainedTokenizerFast

__all__ = ["TinyInternVLSpec", "INTERNVL_CHAT_TEMPLATE", "build_internvl_checkpoint", "build_tiny_internvl",
           "tiny_internvl_path", "internvl_prompt"]

# Bump when the builder changes what it writes, so cached checkpoints are rebuilt.
_BUILDER_VERSION = 1

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
START_IMAGE, END_IMAGE, IMAGE, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"
NAMED_TOKENS = {"start_image_token": START_IMAGE, "end_image_token": END_IMAGE, "context_image_token": IMAGE,
                "video_token": VIDEO}
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, *NAMED_TOKENS.values())

# The published InternVL3_5-*-HF template's user turns: each picture's <IMG_CONTEXT> on a line of its own,
# then the text:  <|im_start|>user\n<IMG_CONTEXT>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n
INTERNVL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<IMG_CONTEXT>\\n' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<video>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def internvl_prompt(text: str, num_images: int = 0) -> str:
    """A one-turn user prompt as the chat template writes it: each picture's marker on its line, then the text."""
    return f"{IM_START}user\n" + f"{IMAGE}\n" * num_images + f"{text}{IM_END}\n{IM_START}assistant\n"


@dataclass(frozen=True)
class TinyInternVLSpec:
    # Qwen3 decoder
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    # InternViT tower, projector and tiling
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_layers: int = 2
    vision_num_heads: int = 2
    image_size: int = 32  # the tile side
    patch_size: int = 8
    downsample_ratio: float = 0.5
    min_patches: int = 1
    max_patches: int = 6
    # checkpoint
    tokenizer_vocab_size: int = 300
    vocab_size: int | None = None  # None: the tokenizer's size
    dtype: str = "float32"
    seed: int = 0

    @property
    def image_seq_length(self) -> int:
        return int((self.image_size // self.patch_size) ** 2 * self.downsample_ratio**2)


def _build_tokenizer(spec: TinyInternVLSpec) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE with Qwen's special tokens and InternVL's named image tokens; no BOS,
    eos <|im_end|>, padding <|endoftext|> on the left."""
    return tiny_tokenizer(spec.tokenizer_vocab_size, added_special_tokens=SPECIAL_TOKENS, eos_token=IM_END, pad_token=ENDOFTEXT,
                          extra_special_tokens=dict(NAMED_TOKENS), chat_template=INTERNVL_CHAT_TEMPLATE)


def _build_config(spec: TinyInternVLSpec, tokenizer: PreTrainedTokenizerFast, initializer_range: float) -> InternVLConfig:
    from transformers import InternVLConfig, InternVLVisionConfig, Qwen3Config

    text = Qwen3Config(
        **text_config_args(spec, tokenizer, initializer_range, bos_token=ENDOFTEXT),
        head_dim=spec.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        use_sliding_window=False,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    vision = InternVLVisionConfig(**vision_sizes(spec), initializer_range=initializer_range)
    return InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        image_seq_length=spec.image_seq_length,
        downsample_ratio=spec.downsample_ratio,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=initializer_range,
    )


def _save_processor(spec: TinyInternVLSpec, tokenizer: PreTrainedTokenizerFast, path: pathlib.Path) -> None:
    """The processor's files as the published checkpoints lay them out."""
    from transformers import GotOcr2ImageProcessorPil

    # The published settings at this tower's tile size: bicubic, ImageNet mean and std, tiles plus a thumbnail
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": spec.image_size, "width": spec.image_size}, crop_to_patches=True, min_patches=spec.min_patches,
        max_patches=spec.max_patches, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
    )
    save_processor_files(
        path, tokenizer, chat_template=INTERNVL_CHAT_TEMPLATE, image_processor=image_processor,
        image_processor_type="GotOcr2ImageProcessorFast",  # as published
        settings={"image_seq_length": spec.image_seq_length, "processor_class": "InternVLProcessor"},
    )


_BUILDER = FamilyBuilder(
    "internvl", _BUILDER_VERSION, TinyInternVLSpec(), "InternVLForConditionalGeneration", _build_tokenizer, _build_config,
    _save_processor, eos_tokens=(IM_END, ENDOFTEXT), bos_token=ENDOFTEXT,
)
# A spec's random-weight checkpoint built into a path, and the path of its cached tiny checkpoint (FamilyBuilder)
build_internvl_checkpoint = build_tiny_internvl = _BUILDER.build
tiny_internvl_path = _BUILDER.path
