"""Random-weight LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`) checkpoints for tests.

Built locally with transformers' own classes (LlavaOnevisionConfig over a SigLIP vision config and a
Qwen2 text config, the PIL `LlavaOnevisionImageProcessorPil`, `LlavaOnevisionProcessor`) and a locally
trained tokenizer with Qwen's special tokens plus `<image>` and `<video>`; laid out as the published
llava-hf checkpoints are: config.json, model.safetensors, the tokenizer files, preprocessor_config.json
(the image processor), processor_config.json (num_image_tokens, vision_feature_select_strategy,
vision_aspect_ratio), video_preprocessor_config.json and chat_template.json. transformers reloads the
model with `LlavaOnevisionForConditionalGeneration.from_pretrained`.

The default spec tiles pictures into 32 px tiles of 4x4 patches (16 tokens a tile) on grids up to 3x3
and caps the unpadded features at `anyres_max_4` tiles' worth, so a large picture's features are
interpolated down as the releases' anyres_max_9 does to their largest grids.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmengine.testing.checkpoint import save_processor_files, text_config_args, vision_sizes
from mmengine.testing.family_builder import FamilyBuilder
from mmengine.testing.tokenizer import tiny_tokenizer

if TYPE_CHECKING:
    from transformers import LlavaOnevisionConfig, PreTrainedTokenizerFast

__all__ = ["TinyOnevisionSpec", "ONEVISION_CHAT_TEMPLATE", "build_onevision_checkpoint", "build_tiny_onevision",
           "tiny_onevision_path", "onevision_prompt"]

# Bump when the builder changes what it writes, so cached checkpoints are rebuilt.
_BUILDER_VERSION = 1

ENDOFTEXT, IM_START, IM_END, IMAGE, VIDEO = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, IMAGE, VIDEO)

# The published llava-onevision-qwen2-*-ov-hf template: a turn's pictures, then its videos, then its text
# after a newline:  <|im_start|>user <image>\nWhat is this?<|im_end|><|im_start|>assistant\n
ONEVISION_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + ' ' -}}"
    "{%- if message['content'] is string -%}{{- '\\n' + message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] | selectattr('type', 'equalto', 'image') -%}{{- '<image>' -}}{%- endfor -%}"
    "{%- for part in message['content'] | selectattr('type', 'equalto', 'video') -%}{{- '<video>' -}}{%- endfor -%}"
    "{%- for part in message['content'] | selectattr('type', 'equalto', 'text') -%}{{- '\\n' + part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def onevision_prompt(text: str, num_images: int = 0, num_videos: int = 0) -> str:
    """A one-turn user prompt as the chat template writes it: the markers, then the text."""
    return f"{IM_START}user " + IMAGE * num_images + VIDEO * num_videos + f"\n{text}{IM_END}{IM_START}assistant\n"


@dataclass(frozen=True)
class TinyOnevisionSpec:
    # Qwen2 decoder
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    # SigLIP tower (its last layer's states, as the releases select) and tiling
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_layers: int = 2
    vision_num_heads: int = 2
    image_size: int = 32  # the tile side
    patch_size: int = 8
    max_grid: int = 3  # tilings from 1x1 to max_grid x max_grid tiles
    vision_aspect_ratio: str = "anyres_max_4"
    # checkpoint
    tokenizer_vocab_size: int = 300
    vocab_size: int | None = None  # None: the tokenizer's size
    dtype: str = "float32"
    seed: int = 0

    @property
    def grid_pinpoints(self) -> list[list[int]]:
        sides = [self.image_size * k for k in range(1, self.max_grid + 1)]
        return [[height, width] for height in sides for width in sides]

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2


# LLaVA-OneVision-Qwen2-0.5B-ov's shapes: a Qwen2-0.5B decoder (24 layers of 896, 14 heads, 2 KV heads, tied
# embeddings, a 151647-token vocabulary) over SigLIP-So400m at 384 px (26 layers of 1152, patches of 14: 729 tokens
# a tile), tilings up to 6x6 tiles of 384 px, anyres_max_9. For GPU figures (random bf16 weights).
ONEVISION_0_5B_SPEC = TinyOnevisionSpec(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    max_position_embeddings=32768, tie_word_embeddings=True, vision_hidden_size=1152, vision_intermediate_size=4304,
    vision_num_layers=26, vision_num_heads=16, image_size=384, patch_size=14, max_grid=6, vision_aspect_ratio="anyres_max_9",
    vocab_size=151647, dtype="bfloat16",
)


def _build_tokenizer(spec: TinyOnevisionSpec) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE with Qwen's special tokens and the image and video markers; no BOS,
    eos <|im_end|>, padding <|endoftext|> on the left."""
    return tiny_tokenizer(spec.tokenizer_vocab_size, added_special_tokens=SPECIAL_TOKENS, eos_token=IM_END, pad_token=ENDOFTEXT)


def _build_config(spec: TinyOnevisionSpec, tokenizer: PreTrainedTokenizerFast, initializer_range: float) -> LlavaOnevisionConfig:
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    ids = tokenizer.convert_tokens_to_ids
    text = Qwen2Config(
        **text_config_args(spec, tokenizer, initializer_range, bos_token=ENDOFTEXT),
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        use_sliding_window=False,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    vision = SiglipVisionConfig(**vision_sizes(spec), vision_use_head=False)
    return LlavaOnevisionConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=ids(IMAGE),
        video_token_index=ids(VIDEO),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        image_grid_pinpoints=spec.grid_pinpoints,
        vision_aspect_ratio=spec.vision_aspect_ratio,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=initializer_range,
    )


def _save_processor(spec: TinyOnevisionSpec, tokenizer: PreTrainedTokenizerFast, path: pathlib.Path) -> None:
    """The processor's files as the published checkpoints lay them out: tokenizer files, the image
    processor's preprocessor_config.json, processor_config.json with the processor's own settings, the
    video processor's settings and chat_template.json."""
    from transformers import LlavaOnevisionImageProcessorPil

    # The published settings at this tower's tile size: bicubic, mean and std 0.5, anyres tiling
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": spec.image_size, "width": spec.image_size}, image_grid_pinpoints=spec.grid_pinpoints,
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )
    settings = {"num_image_tokens": spec.tokens_per_tile, "processor_class": "LlavaOnevisionProcessor",
                "vision_aspect_ratio": spec.vision_aspect_ratio, "vision_feature_select_strategy": "full"}
    video = {"video_processor_type": "LlavaOnevisionVideoProcessor", "processor_class": "LlavaOnevisionProcessor",
             "size": {"height": spec.image_size, "width": spec.image_size}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
             "resample": 3, "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
             "rescale_factor": 1 / 255, "do_sample_frames": False}
    save_processor_files(path, tokenizer, chat_template=ONEVISION_CHAT_TEMPLATE, settings=settings,
                         image_processor=image_processor, video_settings=video)


_BUILDER = FamilyBuilder(
    "llava-onevision", _BUILDER_VERSION, TinyOnevisionSpec(), "LlavaOnevisionForConditionalGeneration", _build_tokenizer,
    _build_config, _save_processor, eos_tokens=(IM_END, ENDOFTEXT), bos_token=ENDOFTEXT,
)
# A spec's random-weight checkpoint built into a path, and the path of its cached tiny checkpoint (FamilyBuilder)
build_onevision_checkpoint = build_tiny_onevision = _BUILDER.build
tiny_onevision_path = _BUILDER.path
