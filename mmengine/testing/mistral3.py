"""Random-weight Mistral 3 (`Mistral3ForConditionalGeneration`) checkpoints for tests.

Built locally with transformers' own classes (Mistral3Config over a PixtralVisionConfig and a Mistral text config,
the PIL `PixtralImageProcessorPil`, `PixtralProcessor`) and a locally trained tokenizer with Mistral's control
tokens `<s>`, `</s>`, `[INST]`, `[/INST]`, `[IMG]`, `[IMG_BREAK]`, `[IMG_END]`; laid out as the published
mistralai/Mistral-Small-3.1-*-2503 checkpoints are: config.json, model.safetensors, the tokenizer files,
preprocessor_config.json (the tower's patch_size, as published), processor_config.json (patch_size,
spatial_merge_size) and chat_template.json.

The default spec: 4 px patches merged 2x2 into 8 px tokens, pictures resized to a longest edge of at most 64 px
(up to 8x8 [IMG] tokens and a break per row).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmengine.testing.checkpoint import save_processor_files, text_config_args, vision_sizes
from mmengine.testing.family_builder import FamilyBuilder
from mmengine.testing.tokenizer import tiny_tokenizer

if TYPE_CHECKING:
    from transformers import Mistral3Config, PreTrainedTokenizerFast

__all__ = ["TinyMistral3Spec", "MISTRAL3_CHAT_TEMPLATE", "build_mistral3_checkpoint", "tiny_mistral3_path", "mistral3_prompt"]

_BUILDER_VERSION = 1

BOS, EOS, PAD, INST, END_INST = "<s>", "</s>", "<pad>", "[INST]", "[/INST]"
IMAGE, IMAGE_BREAK, IMAGE_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
SPECIAL_TOKENS = (BOS, EOS, PAD, INST, END_INST, IMAGE, IMAGE_BREAK, IMAGE_END)

# The published template's user turn, without its system prompt: <s>[INST] the pictures' [IMG]s, the text [/INST]
MISTRAL3_CHAT_TEMPLATE = (
    "{{- '<s>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '[INST]' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '[IMG]' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}{{- '[/INST]' -}}{%- else -%}{{- '</s>' -}}{%- endif -%}"
    "{%- endfor -%}"
)


def mistral3_prompt(text: str, num_images: int = 0) -> str:
    """A one-turn user prompt as the chat template writes it: the pictures' markers, then the text."""
    return f"{BOS}{INST}" + IMAGE * num_images + f"{text}{END_INST}"


@dataclass(frozen=True)
class TinyMistral3Spec:
    # Mistral decoder
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    # Pixtral tower, merger and resize
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_layers: int = 2
    vision_num_heads: int = 2
    patch_size: int = 4
    spatial_merge_size: int = 2
    longest_edge: int = 64
    # checkpoint
    tokenizer_vocab_size: int = 300
    vocab_size: int | None = None  # None: the tokenizer's size
    dtype: str = "float32"
    seed: int = 0


def _build_tokenizer(spec: TinyMistral3Spec) -> PreTrainedTokenizerFast:
    return tiny_tokenizer(spec.tokenizer_vocab_size, added_special_tokens=SPECIAL_TOKENS, bos_token=BOS, eos_token=EOS,
                          pad_token=PAD, chat_template=MISTRAL3_CHAT_TEMPLATE)


def _build_config(spec: TinyMistral3Spec, tokenizer: PreTrainedTokenizerFast, initializer_range: float) -> Mistral3Config:
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    text = MistralConfig(
        **text_config_args(spec, tokenizer, initializer_range), head_dim=spec.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta}, sliding_window=None,
        tie_word_embeddings=False,
    )
    vision = PixtralVisionConfig(
        **vision_sizes(spec, image_size=spec.longest_edge), head_dim=spec.vision_hidden_size // spec.vision_num_heads,
        initializer_range=initializer_range,
    )
    return Mistral3Config(text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
                          spatial_merge_size=spec.spatial_merge_size, vision_feature_layer=-1, multimodal_projector_bias=False,
                          projector_hidden_act="gelu", tie_word_embeddings=False)


def _save_processor(spec: TinyMistral3Spec, tokenizer: PreTrainedTokenizerFast, path: pathlib.Path) -> None:
    from transformers import PixtralImageProcessorPil

    # The published settings: bicubic, CLIP's mean and std, the tower's patch size (the processor merges it)
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": spec.longest_edge}, patch_size={"height": spec.patch_size, "width": spec.patch_size},
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    settings = {"patch_size": spec.patch_size, "spatial_merge_size": spec.spatial_merge_size, "image_token": IMAGE,
                "image_break_token": IMAGE_BREAK, "image_end_token": IMAGE_END, "processor_class": "PixtralProcessor"}
    save_processor_files(path, tokenizer, chat_template=MISTRAL3_CHAT_TEMPLATE, settings=settings,
                         image_processor=image_processor, image_processor_type="PixtralImageProcessor")  # as published


_BUILDER = FamilyBuilder("mistral3", _BUILDER_VERSION, TinyMistral3Spec(), "Mistral3ForConditionalGeneration", _build_tokenizer,
                         _build_config, _save_processor)
# A spec's random-weight checkpoint built into a path, and the path of its cached tiny checkpoint (FamilyBuilder)
build_mistral3_checkpoint = _BUILDER.build
tiny_mistral3_path = _BUILDER.path
