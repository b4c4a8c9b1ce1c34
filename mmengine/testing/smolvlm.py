"""Random-weight Idefics3 (`Idefics3ForConditionalGeneration`) and SmolVLM (`SmolVLMForConditionalGeneration`)
checkpoints for tests.

Built locally with transformers' own classes (Idefics3Config / SmolVLMConfig over their vision config and a
Llama text config, the PIL `Idefics3ImageProcessorPil` / `SmolVLMImageProcessorPil`) and a locally trained
tokenizer with the families' special tokens (`<fake_token_around_image>`, `<image>`, `<global-img>`,
`<end_of_utterance>`, `<row_1_col_1>` ... `<row_6_col_6>`); laid out as the published checkpoints are:
config.json, model.safetensors, generation_config.json, the tokenizer files, preprocessor_config.json,
processor_config.json (image_seq_len), chat_template.json, and for SmolVLM (SmolVLM2's layout)
video_preprocessor_config.json. transformers reloads the model with `AutoModelForImageTextToText`.

The idefics3 spec cuts pictures into 32 px tiles of 8x8 patches, pixel-shuffled by 2 into 16 tokens a tile,
after resizing them to a longest edge of 96 px (grids up to 3x3, plus the global image); the smolvlm spec
64 px tiles of 16x16 patches shuffled by 4 (as SmolVLM2's scale factor) into 16 tokens, at most 2x2 tiles,
with tied embeddings. (The published SmolVLM-256M/500M/2.2B v1 checkpoints are Idefics3 checkpoints.)
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmengine.testing.checkpoint import (
    save_processor_files,
    text_config_args,
    update_json,
    vision_sizes,
)
from mmengine.testing.family_builder import FamilyBuilder
from mmengine.testing.tokenizer import tiny_tokenizer
from mmengine.testing.weights import TINY_INITIALIZER_RANGE

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

__all__ = ["TinySmolVLMSpec", "IDEFICS3_SPEC", "SMOLVLM_SPEC", "IDEFICS3_CHAT_TEMPLATE", "SMOLVLM_CHAT_TEMPLATE",
           "build_smolvlm_checkpoint", "build_tiny_smolvlm", "tiny_smolvlm_path", "smolvlm_prompt"]

# Bump when the builder changes what it writes, so cached checkpoints are rebuilt.
_BUILDER_VERSION = 1

FAKE, IMAGE, GLOBAL, END_OF_UTTERANCE = "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"
ROW_COL_TOKENS = tuple(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))
# (bos, eos of the text model) and the tokens before the image ones, as each family's tokenizer has them
_TEXT_TOKENS = {"idefics3": ("<|begin_of_text|>", "<|end_of_text|>", ()), "smolvlm": ("<|im_start|>", "<|endoftext|>", ("<|im_end|>",))}
# The named tokens SmolVLMProcessor reads from the tokenizer (as SmolVLM2's tokenizer_config has them)
_NAMED_TOKENS = {"fake_image_token": FAKE, "image_token": IMAGE, "global_image_token": GLOBAL,
                 "end_of_utterance_token": END_OF_UTTERANCE}

# The published templates: Idefics3-8B-Llama3's, and SmolVLM2's (which also writes <video>)
_TURNS = (
    "{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IDEFICS3_CHAT_TEMPLATE = "<|begin_of_text|>" + _TURNS
SMOLVLM_CHAT_TEMPLATE = "<|im_start|>" + _TURNS


@dataclass(frozen=True)
class TinySmolVLMSpec:
    family: str = "idefics3"  # "idefics3" | "smolvlm"
    # Llama decoder
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 100_000.0
    tie_word_embeddings: bool = False
    # vision tower, connector and image processor
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_layers: int = 2
    vision_num_heads: int = 2
    image_size: int = 32  # the tile side (max_image_size's longest_edge)
    patch_size: int = 4
    scale_factor: int = 2
    longest_edge: int = 96  # every picture is resized to this longest edge before it is cut into tiles
    do_image_splitting: bool = True
    # checkpoint
    tokenizer_vocab_size: int = 300
    vocab_size: int | None = None  # None: the tokenizer's size
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in _TEXT_TOKENS:
            raise ValueError(f"family must be one of {', '.join(_TEXT_TOKENS)}, got {self.family!r}")

    @property
    def image_seq_len(self) -> int:
        """Tokens a tile makes: its patches, pixel-shuffled by scale_factor in each direction."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


IDEFICS3_SPEC = TinySmolVLMSpec()
SMOLVLM_SPEC = TinySmolVLMSpec(family="smolvlm", tie_word_embeddings=True, image_size=64, scale_factor=4, longest_edge=128)


def smolvlm_prompt(text: str, num_images: int = 0, family: str = "idefics3") -> str:
    """A one-turn user prompt as the family's chat template writes it: the image markers, then the text."""
    bos = _TEXT_TOKENS[family][0]
    return f"{bos}User" + (":" + IMAGE * num_images if num_images else ": ") + f"{text}{END_OF_UTTERANCE}\nAssistant:"


def _build_tokenizer(spec: TinySmolVLMSpec) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE with the family's special tokens; no BOS is added (the template writes it)."""
    bos, eos, others = _TEXT_TOKENS[spec.family]
    tokens = (bos, eos, *others, FAKE, IMAGE, END_OF_UTTERANCE, GLOBAL, *ROW_COL_TOKENS)
    named = {"extra_special_tokens": dict(_NAMED_TOKENS)} if spec.family == "smolvlm" else {}
    return tiny_tokenizer(spec.tokenizer_vocab_size, added_special_tokens=tokens, bos_token=bos, eos_token=eos, pad_token=eos,
                          add_bos_token=False, **named)


def _build_config(spec: TinySmolVLMSpec, tokenizer: PreTrainedTokenizerFast, initializer_range: float) -> PretrainedConfig:
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig, SmolVLMConfig, SmolVLMVisionConfig

    config_class, vision_class = (Idefics3Config, Idefics3VisionConfig) if spec.family == "idefics3" else (SmolVLMConfig, SmolVLMVisionConfig)
    text = LlamaConfig(
        **text_config_args(spec, tokenizer, initializer_range),
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    vision = vision_class(**vision_sizes(spec), initializer_range=initializer_range)
    return config_class(
        text_config=text,
        vision_config=vision,
        scale_factor=spec.scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
    )


def _save_processor(spec: TinySmolVLMSpec, tokenizer: PreTrainedTokenizerFast, path: pathlib.Path) -> None:
    """The processor's files as the published checkpoints lay them out."""
    from transformers import Idefics3ImageProcessorPil, SmolVLMImageProcessorPil

    image_class = Idefics3ImageProcessorPil if spec.family == "idefics3" else SmolVLMImageProcessorPil
    # The published settings at this tower's tile size: Lanczos, mean and std 0.5, splitting into tiles
    image_processor = image_class(size={"longest_edge": spec.longest_edge}, max_image_size={"longest_edge": spec.image_size},
                                  do_image_splitting=spec.do_image_splitting, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor_class = "Idefics3Processor" if spec.family == "idefics3" else "SmolVLMProcessor"
    template = IDEFICS3_CHAT_TEMPLATE if spec.family == "idefics3" else SMOLVLM_CHAT_TEMPLATE
    video = None
    if spec.family == "smolvlm":  # SmolVLM2's video settings (the engine refuses videos; transformers' part needs torchvision)
        video = {"video_processor_type": "SmolVLMVideoProcessor", "processor_class": processor_class, "do_resize": True,
                 "size": {"longest_edge": spec.image_size}, "max_image_size": {"longest_edge": spec.image_size},
                 "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 1, "do_rescale": True, "do_normalize": True,
                 "do_convert_rgb": True, "rescale_factor": 1 / 255, "do_pad": True, "fps": 1, "num_frames": 8,
                 "do_sample_frames": True}
    save_processor_files(
        path, tokenizer, chat_template=template, image_processor=image_processor,
        image_processor_type=image_class.__name__.removesuffix("Pil"),
        settings={"image_seq_len": spec.image_seq_len, "processor_class": processor_class}, video_settings=video,
    )
    update_json(path / "tokenizer_config.json", processor_class=processor_class)


# Each family's builder (FamilyBuilder): as the published instruction-tuned checkpoints, a turn ends at
# <end_of_utterance> (or the text's eos)
_BUILDERS = {
    family: FamilyBuilder(family, _BUILDER_VERSION, spec, model_class, _build_tokenizer, _build_config, _save_processor,
                          eos_tokens=(END_OF_UTTERANCE, _TEXT_TOKENS[family][1]))
    for family, spec, model_class in (("idefics3", IDEFICS3_SPEC, "Idefics3ForConditionalGeneration"),
                                      ("smolvlm", SMOLVLM_SPEC, "SmolVLMForConditionalGeneration"))
}


def build_smolvlm_checkpoint(path: str | os.PathLike, spec: TinySmolVLMSpec = IDEFICS3_SPEC, *, device: str = "cpu",
                             dtype: str | None = None, initializer_range: float = TINY_INITIALIZER_RANGE) -> pathlib.Path:
    """Builds a random-weight checkpoint of `spec` with its family's builder (FamilyBuilder.build); returns the path."""
    return _BUILDERS[spec.family].build(path, spec, device=device, dtype=dtype, initializer_range=initializer_range)


# Builds and saves a tiny test checkpoint of a spec on CPU into a path (the checkpoint builder's defaults); returns the path.
build_tiny_smolvlm = build_smolvlm_checkpoint


def tiny_smolvlm_path(spec: TinySmolVLMSpec = IDEFICS3_SPEC, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The path of a cached tiny checkpoint for `spec`, building it on first use (FamilyBuilder.path)."""
    return _BUILDERS[spec.family].path(spec, cache_dir)
