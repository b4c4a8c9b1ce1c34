"""Random-weight Llama 4 (`Llama4ForConditionalGeneration`) checkpoints for tests and the demo.

Built locally with transformers' own classes (Llama4Config over a Llama4TextConfig and a Llama4VisionConfig) and a
locally trained tokenizer with Llama 4's control tokens (`<|begin_of_text|>`, `<|header_start|>`, `<|eot|>`,
`<|image_start|>`, `<|image|>`, `<|patch|>`, the tile separators, ...); laid out as the published
meta-llama/Llama-4-*-Instruct checkpoints are: config.json, model.safetensors, the tokenizer files,
preprocessor_config.json (Llama4ImageProcessor's settings), processor_config.json and chat_template.json.
transformers' Llama4ImageProcessor needs torchvision, so the preprocessor settings are written as JSON here.

The default spec: four decoder layers (three with RoPE and chunked attention over 16-token chunks, the fourth NoPE
with attention temperature tuning), MoE layers interleaved with dense ones (4 routed experts, top-1, and the shared
expert), QK L2 norm; 32 px tiles of 4 px patches, pixel-shuffled to 16 tokens a tile, up to 4 tiles and the global one.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmengine.testing.checkpoint import save_processor_files, text_config_args, vision_sizes
from mmengine.testing.family_builder import FamilyBuilder
from mmengine.testing.tokenizer import tiny_tokenizer

if TYPE_CHECKING:
    from transformers import Llama4Config, PreTrainedTokenizerFast

__all__ = ["TinyLlama4Spec", "LLAMA4_CHAT_TEMPLATE", "build_llama4_checkpoint", "tiny_llama4_path", "llama4_prompt"]

_BUILDER_VERSION = 1

BOS, EOT, EOS, PAD = "<|begin_of_text|>", "<|eot|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"
HEADER_START, HEADER_END = "<|header_start|>", "<|header_end|>"
IMAGE_START, IMAGE_END, IMAGE, PATCH = "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>"
TILE_X, TILE_Y = "<|tile_x_separator|>", "<|tile_y_separator|>"
SPECIAL_TOKENS = (BOS, EOS, EOT, PAD, HEADER_START, HEADER_END, IMAGE_START, IMAGE_END, IMAGE, PATCH, TILE_X, TILE_Y)

# The published template's user turn (without its system prompt): the pictures' <|image|>s, then the text
LLAMA4_CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|image|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|eot|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|header_start|>assistant<|header_end|>\\n\\n' -}}{%- endif -%}"
)


def llama4_prompt(text: str, num_images: int = 0) -> str:
    """A one-turn user prompt as the chat template writes it: the pictures' markers, then the text."""
    return f"{BOS}{HEADER_START}user{HEADER_END}\n\n" + IMAGE * num_images + f"{text}{EOT}{HEADER_START}assistant{HEADER_END}\n\n"


@dataclass(frozen=True)
class TinyLlama4Spec:
    # text model
    hidden_size: int = 64
    intermediate_size: int = 64  # each routed expert's and the shared expert's
    intermediate_size_mlp: int = 128  # the dense layers'
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_local_experts: int = 4
    num_experts_per_tok: int = 1
    interleave_moe_layer_step: int = 2
    attention_chunk_size: int = 16
    no_rope_layer_interval: int = 4
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: int = 8
    attn_scale: float = 0.1
    max_position_embeddings: int = 4096
    rope_theta: float = 500_000.0
    # vision tower, pixel shuffle, projector and tiles
    vision_hidden_size: int = 32
    vision_num_layers: int = 2
    vision_num_heads: int = 2
    image_size: int = 32
    patch_size: int = 4
    pixel_shuffle_ratio: float = 0.5
    vision_output_dim: int = 48
    max_patches: int = 4  # tiles a picture may be cut into (the global tile besides)
    # checkpoint
    tokenizer_vocab_size: int = 300
    vocab_size: int | None = None  # None: the tokenizer's size
    dtype: str = "float32"
    seed: int = 0


def _build_tokenizer(spec: TinyLlama4Spec) -> PreTrainedTokenizerFast:
    return tiny_tokenizer(spec.tokenizer_vocab_size, added_special_tokens=SPECIAL_TOKENS, bos_token=BOS, eos_token=EOT, pad_token=PAD,
                          chat_template=LLAMA4_CHAT_TEMPLATE)


def _build_config(spec: TinyLlama4Spec, tokenizer: PreTrainedTokenizerFast, initializer_range: float) -> Llama4Config:
    from transformers import Llama4Config, Llama4TextConfig, Llama4VisionConfig

    ids = tokenizer.convert_tokens_to_ids
    text = Llama4TextConfig(
        **text_config_args(spec, tokenizer, initializer_range),
        intermediate_size_mlp=spec.intermediate_size_mlp, head_dim=spec.head_dim, num_local_experts=spec.num_local_experts,
        num_experts_per_tok=spec.num_experts_per_tok, interleave_moe_layer_step=spec.interleave_moe_layer_step,
        attention_chunk_size=spec.attention_chunk_size, no_rope_layer_interval=spec.no_rope_layer_interval,
        use_qk_norm=spec.use_qk_norm, attn_temperature_tuning=spec.attn_temperature_tuning, floor_scale=spec.floor_scale,
        attn_scale=spec.attn_scale,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta}, tie_word_embeddings=False,
    )
    shuffled = int(spec.vision_hidden_size / spec.pixel_shuffle_ratio**2)  # the pixel shuffle's channels
    vision = Llama4VisionConfig(
        **vision_sizes(spec, intermediate_size=shuffled), vision_output_dim=spec.vision_output_dim,
        pixel_shuffle_ratio=spec.pixel_shuffle_ratio,
        projector_input_dim=spec.vision_output_dim, projector_output_dim=spec.vision_output_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=initializer_range,
    )
    return Llama4Config(text_config=text, vision_config=vision, image_token_index=ids(PATCH), boi_token_index=ids(IMAGE_START),
                        eoi_token_index=ids(IMAGE_END), tie_word_embeddings=False)


def _save_processor(spec: TinyLlama4Spec, tokenizer: PreTrainedTokenizerFast, path: pathlib.Path) -> None:
    settings = {
        "image_processor_type": "Llama4ImageProcessorFast", "processor_class": "Llama4Processor",
        "size": {"height": spec.image_size, "width": spec.image_size}, "max_patches": spec.max_patches,
        "resize_to_max_canvas": False, "resample": 2, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
    }
    processor = {"patch_size": spec.patch_size, "pixel_shuffle_ratio": spec.pixel_shuffle_ratio, "fake_image_token": IMAGE,
                 "image_token": IMAGE, "processor_class": "Llama4Processor"}
    save_processor_files(path, tokenizer, chat_template=LLAMA4_CHAT_TEMPLATE, settings=processor, image_processor=settings)


_BUILDER = FamilyBuilder(
    "llama4", _BUILDER_VERSION, TinyLlama4Spec(), "Llama4ForConditionalGeneration", _build_tokenizer, _build_config,
    _save_processor,
    quiet=("Casting complex values to real",),  # the vision rotary's complex buffer (not saved), cast to the weights' dtype
)
# A spec's random-weight checkpoint built into a path, and the path of its cached tiny checkpoint (FamilyBuilder)
build_llama4_checkpoint = _BUILDER.build
tiny_llama4_path = _BUILDER.path
