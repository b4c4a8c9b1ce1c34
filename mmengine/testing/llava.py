"""Random-weight LLaVA-1.5-style checkpoints for tests, demos and benchmarks.

Everything is built locally with transformers' own classes and saved with `save_pretrained`, so
transformers and mmengine's loader read exactly the same files. No network or model hub is needed.

- `build_tiny_llava` / `tiny_llava_path`: tiny shapes in fp32 on CPU, with weights scaled so that
  greedy parity between implementations is well defined (tests, the demo).
- `build_llava_checkpoint` with `LLAVA_1_5_7B_SPEC`: a real model's shape, built directly on a GPU in
  bf16 at the real models' weight scale (benchmarks). Never commit one: it is 14 GB.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmengine.testing.cache import cached_build, spec_key
from mmengine.testing.checkpoint import save_checkpoint, special_token_ids, text_config_args, vision_sizes
from mmengine.testing.tokenizer import tiny_tokenizer
from mmengine.testing.weights import REAL_INITIALIZER_RANGE, TINY_INITIALIZER_RANGE

if TYPE_CHECKING:
    import torch
    from transformers import LlavaConfig, LlavaProcessor, PreTrainedTokenizerFast

__all__ = [
    "TinyLlavaSpec",
    "LLAVA_1_5_7B_SPEC",
    "build_llava_checkpoint",
    "build_tiny_llava",
    "tiny_llava_path",
    "CHAT_TEMPLATE",
]

# Bump when the builder changes what it writes, so cached checkpoints are rebuilt.
_BUILDER_VERSION = 1

BOS, EOS, PAD, UNK, IMAGE = "<s>", "</s>", "<pad>", "<unk>", "<image>"

# LLaVA-1.5 (vicuna_v1) conversation format:
#   [system + " "] "USER: <image>\nWhat is this?" " ASSISTANT: answer</s>" "USER: ..." " ASSISTANT:"
# `content` is a string or a list of {"type": "text", "text": ...} / {"type": "image"} parts, rendered in
# order; an image part renders as "<image>\n".
CHAT_TEMPLATE = r"""
{%- for message in messages -%}
  {%- if message['content'] is string -%}
    {%- set parts = [{'type': 'text', 'text': message['content']}] -%}
  {%- else -%}
    {%- set parts = message['content'] -%}
  {%- endif -%}
  {%- if message['role'] == 'system' -%}
    {%- for part in parts if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}{{ ' ' }}
  {%- elif message['role'] == 'user' -%}
    {{ 'USER: ' }}
    {%- for part in parts -%}
      {%- if part['type'] == 'image' -%}{{ '<image>\n' }}
      {%- elif part['type'] == 'text' -%}{{ part['text'] }}
      {%- endif -%}
    {%- endfor -%}
  {%- elif message['role'] == 'assistant' -%}
    {{ ' ASSISTANT: ' }}
    {%- for part in parts if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}{{ '</s>' }}
  {%- else -%}
    {{ raise_exception('unsupported role: ' + message['role']) }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ ' ASSISTANT:' }}{%- endif -%}
""".strip()

@dataclass(frozen=True)
class TinyLlavaSpec:
    """Shape and flavour of a LLaVA-1.5-style checkpoint; tiny by default (`LLAVA_1_5_7B_SPEC` is a
    real shape). Equal specs built on the same device in the same dtype give byte-identical checkpoints."""

    text_model: str = "llama"  # "llama" | "mistral" | "qwen2"
    vision_model: str = "clip"  # "clip" | "siglip"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_layers: int = 3
    vision_num_heads: int = 2
    image_size: int = 32
    patch_size: int = 8
    vision_feature_layer: int | tuple[int, ...] = -2
    vision_feature_select_strategy: str | None = None  # None = "default" for clip, "full" for siglip
    projector_hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    tokenizer_vocab_size: int = 400  # target for BPE training
    # The model's vocabulary (embedding and lm_head rows). None: len(tokenizer) exactly. Larger pads
    # it past the tokenizer, as llava-hf checkpoints do (32064 rows for 32002 tokens).
    vocab_size: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.text_model not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"text_model must be 'llama', 'mistral' or 'qwen2', got {self.text_model!r}")
        if self.vision_model not in ("clip", "siglip"):
            raise ValueError(f"vision_model must be 'clip' or 'siglip', got {self.vision_model!r}")
        if self.vision_feature_select_strategy not in (None, "default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy must be None, 'default' or 'full', "
                f"got {self.vision_feature_select_strategy!r}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size <= 0):
            raise ValueError(f"vocab_size must be None or a positive int, got {self.vocab_size!r}")

    @property
    def select_strategy(self) -> str:
        """The effective vision feature select strategy."""
        if self.vision_feature_select_strategy is not None:
            return self.vision_feature_select_strategy
        return "default" if self.vision_model == "clip" else "full"

    @property
    def num_image_tokens(self) -> int:
        """Image placeholder tokens per image (CLS counted for clip, then dropped by "default")."""
        cls = 1 if self.vision_model == "clip" else 0
        return (self.image_size // self.patch_size) ** 2 + cls - (self.select_strategy == "default")


# LLaVA-1.5-7B (llava-hf/llava-1.5-7b-hf): a Vicuna-7B decoder (Llama: 4096 hidden, 11008 MLP, 32 layers,
# 32 heads, 32064-row vocabulary) over CLIP ViT-L/14 at 336 px (1024 hidden, 4096 MLP, 24 layers, 16 heads:
# 24x24 patches, CLS dropped = 576 image tokens), layer -2 features, GELU projector. 7,063,427,072
# parameters, like the published checkpoint; the tokenizer is the small built-in one, so text is noise.
LLAVA_1_5_7B_SPEC = TinyLlavaSpec(
    text_model="llama",
    vision_model="clip",
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vision_hidden_size=1024,
    vision_intermediate_size=4096,
    vision_num_layers=24,
    vision_num_heads=16,
    image_size=336,
    patch_size=14,
    vision_feature_layer=-2,
    projector_hidden_act="gelu",
    max_position_embeddings=4096,
    vocab_size=32064,
)


def _build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE wrapped as a transformers fast tokenizer.

    Ids 0..2 are <unk>, <s>, </s> (as in Llama); <image> and <pad> are added special tokens at the end
    of the vocabulary (as in llava-hf checkpoints). Every encoded sequence starts with <s>.
    """
    return tiny_tokenizer(vocab_size, leading_special_tokens=[UNK, BOS, EOS], added_special_tokens=[IMAGE, PAD],
                          bos_first=True, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD)


def _build_config(
    spec: TinyLlavaSpec, tokenizer: PreTrainedTokenizerFast, initializer_range: float | None = None
) -> LlavaConfig:
    """The LlavaConfig for `spec`, with the vocabulary and special ids taken from `tokenizer`.

    `initializer_range` None: the tiny checkpoints' scale (TINY_INITIALIZER_RANGE)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, MistralConfig, Qwen2Config, SiglipVisionConfig

    if initializer_range is None:
        initializer_range = TINY_INITIALIZER_RANGE
    special_ids = special_token_ids(tokenizer)
    text_kwargs = dict(
        **text_config_args(spec, tokenizer, initializer_range),
        head_dim=spec.head_dim or spec.hidden_size // spec.num_attention_heads,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    if spec.text_model == "llama":
        text_config = LlamaConfig(**text_kwargs)
    elif spec.text_model == "mistral":
        text_config = MistralConfig(sliding_window=None, **text_kwargs)
    else:
        text_config = Qwen2Config(use_sliding_window=False, **text_kwargs)

    vision_kwargs = vision_sizes(spec)
    if spec.vision_model == "clip":
        vision_config = CLIPVisionConfig(initializer_range=initializer_range, **vision_kwargs)
    else:
        # The SigLIP pooling head is unused by LLaVA; leave it out so the checkpoint has no dead weights.
        vision_config = SiglipVisionConfig(vision_use_head=False, **vision_kwargs)

    feature_layer = spec.vision_feature_layer
    return LlavaConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        image_seq_length=spec.num_image_tokens,
        vision_feature_layer=list(feature_layer) if isinstance(feature_layer, tuple) else feature_layer,
        vision_feature_select_strategy=spec.select_strategy,
        projector_hidden_act=spec.projector_hidden_act,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=initializer_range,
        **special_ids,
    )


def _build_processor(spec: TinyLlavaSpec, tokenizer: PreTrainedTokenizerFast) -> LlavaProcessor:
    """The LlavaProcessor (image processor + tokenizer + chat template) for `spec`."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor, SiglipImageProcessorPil

    # The *Pil classes are what CLIPImageProcessor/SiglipImageProcessor resolve to without torchvision;
    # constructing them directly avoids the fallback warning. They save as the base class name, so
    # AutoProcessor loads CLIPImageProcessor (torchvision backend) where torchvision is installed and
    # CLIPImageProcessorPil where it is not: same settings, same image placeholder count.
    if spec.vision_model == "clip":
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": spec.image_size},
            crop_size={"height": spec.image_size, "width": spec.image_size},
        )
    else:
        image_processor = SiglipImageProcessorPil(size={"height": spec.image_size, "width": spec.image_size})
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy=spec.select_strategy,
        num_additional_image_tokens=1 if spec.vision_model == "clip" else 0,
        chat_template=CHAT_TEMPLATE,
    )


def build_llava_checkpoint(
    path: str | os.PathLike,
    spec: TinyLlavaSpec = TinyLlavaSpec(),
    *,
    device: str = "cpu",
    dtype: torch.dtype | str = "float32",
    initializer_range: float = REAL_INITIALIZER_RANGE,
    max_shard_size: str | None = None,
) -> pathlib.Path:
    """Builds a random-weight checkpoint of `spec` and saves it (weights, config, processor, tokenizer,
    chat template) with `save_pretrained` into `path`; returns the path.

    The weights are created directly on `device` in `dtype` (no fp32 copy, no host round trip), drawn
    with transformers' own initialization at `initializer_range` (0.02, the real models' scale; SigLIP
    towers keep their fixed init) from seed `spec.seed`. On a GPU the LLaVA-1.5-7B shape takes about
    20 s and 14 GB:

        build_llava_checkpoint(path, LLAVA_1_5_7B_SPEC, device="cuda", dtype="bfloat16")

    `max_shard_size` (e.g. "200KB") makes a sharded safetensors checkpoint (model.safetensors.index.json).
    """
    from transformers import LlavaForConditionalGeneration

    tokenizer = _build_tokenizer(spec.tokenizer_vocab_size)
    return save_checkpoint(
        path, LlavaForConditionalGeneration, _build_config(spec, tokenizer, initializer_range), tokenizer,
        _build_processor(spec, tokenizer).save_pretrained, seed=spec.seed, device=device, dtype=dtype,
        max_shard_size=max_shard_size,
    )


def build_tiny_llava(
    path: str | os.PathLike, spec: TinyLlavaSpec = TinyLlavaSpec(), *, max_shard_size: str | None = None
) -> pathlib.Path:
    """Builds and saves a tiny test checkpoint (fp32, on CPU, weights at the parity-friendly scale
    explained at TINY_INITIALIZER_RANGE); returns the path.

    `max_shard_size` (e.g. "200KB") makes a sharded safetensors checkpoint (model.safetensors.index.json).
    """
    return build_llava_checkpoint(
        path, spec, device="cpu", dtype="float32", initializer_range=TINY_INITIALIZER_RANGE, max_shard_size=max_shard_size
    )


def tiny_llava_path(spec: TinyLlavaSpec = TinyLlavaSpec(), cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The path of a cached checkpoint for `spec`, building it on first use.

    The cache dir defaults to $MMENGINE_CACHE_DIR or ~/.cache/mmengine/tiny-models. The checkpoint is built
    in a temporary directory and renamed into place, so concurrent callers never see a partial build.
    """
    name = f"llava-{spec.text_model}-{spec.vision_model}-{spec_key(spec, _BUILDER_VERSION)}"
    return cached_build(name, lambda path: build_tiny_llava(path, spec), cache_dir)
