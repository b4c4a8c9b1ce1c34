"""Random-weight Gemma 4 (`Gemma4ForConditionalGeneration`) checkpoints for tests.

Built locally with transformers' own classes (Gemma4Config, the PIL `Gemma4ImageProcessorPil`,
`Gemma4AudioFeatureExtractor`) and a locally trained tokenizer carrying Gemma 4's named special
tokens; saved with `save_pretrained` (config, generation config, safetensors, tokenizer,
processor_config.json with the image processor's and feature extractor's settings, chat template).
`transformers` reloads the model with `Gemma4ForConditionalGeneration.from_pretrained`, and
`mmengine.models.gemma4_vision.load_gemma4_processor` the processor, with or without torchvision.

The default spec exercises every decoder feature at once: sliding and full layers (the last full),
a sliding window of 8, bidirectional attention over image tokens, full layers with their own head
dim and K = V heads, per-layer embeddings, KV-shared layers with double-wide MLPs and a final logit
softcap; MoE is a field away. Norm weights, layer scalars, the vision standardization and the
clipped linears' bounds are drawn off their constant init, so an implementation that drops one
shows in a parity test.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmengine.testing.checkpoint import update_json
from mmengine.testing.family_builder import FamilyBuilder
from mmengine.testing.gemma3 import gemma_text_config_args, gemma_tokenizer
from mmengine.testing.weights import TINY_INITIALIZER_RANGE

if TYPE_CHECKING:
    import torch
    from transformers import Gemma4Config, PreTrainedTokenizerFast, ProcessorMixin

__all__ = ["TinyGemma4Spec", "GEMMA4_CHAT_TEMPLATE", "build_tiny_gemma4", "tiny_gemma4_path", "gemma4_prompt"]

# Bump when the builder changes what it writes, so cached checkpoints are rebuilt.
_BUILDER_VERSION = 1

SLIDING, FULL = "sliding_attention", "full_attention"

# The named special tokens of the published tokenizer (Gemma4Processor reads image/boi/eoi and
# audio/boa/eoa; it wants boa/eoa even for text-only prompts).
NAMED_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
    "soc_token": "<|channel>",
    "eoc_token": "<channel|>",
    "think_token": "<|think|>",
    "str_token": "<|tool_response>",
    "etr_token": "<tool_response|>",
}
# Gemma4Processor adds <|video|> to the tokenizer itself; in the vocabulary from the start, the
# model's embedding table covers it.
VIDEO_TOKEN = "<|video|>"

# Gemma 4's turn format (the published template also renders tools and thinking):
#   <bos><|turn>user\n\n\n<|image|>\n\nWhat is this?<turn|>\n<|turn>model\n
GEMMA4_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content | trim -}}"
    "{%- else -%}{%- for item in content -%}"
    "{%- if item['type'] == 'text' -%}{{- item['text'] | trim -}}"
    "{%- elif item['type'] == 'image' -%}{{- '\\n\\n<|image|>\\n\\n' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '\\n\\n<|video|>\\n\\n' -}}"
    "{%- elif item['type'] == 'audio' -%}{{- '\\n\\n<|audio|>\\n\\n' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' -}}{{- render(message['content']) -}}{{- '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)


def gemma4_prompt(text: str, num_images: int = 0, num_audios: int = 0) -> str:
    """A one-turn user prompt with `num_images` image markers and then `num_audios` audio markers before the
    text, as the template writes them."""
    media = "\n\n<|image|>\n\n" * num_images + "\n\n<|audio|>\n\n" * num_audios
    return "<bos><|turn>user\n" + media + text + "<turn|>\n<|turn>model\n"


@dataclass(frozen=True)
class TinyGemma4Spec:
    # decoder
    hidden_size: int = 64
    intermediate_size: int = 128
    layer_types: tuple[str, ...] = (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16  # sliding layers
    global_head_dim: int = 32  # full layers
    num_global_key_value_heads: int = 1  # full layers (with attention_k_eq_v)
    attention_k_eq_v: bool = True
    sliding_window: int = 8
    use_bidirectional_attention: str | None = "vision"
    hidden_size_per_layer_input: int = 16  # per-layer embeddings; 0: none
    num_kv_shared_layers: int = 2
    use_double_wide_mlp: bool = True
    final_logit_softcapping: float | None = 30.0
    enable_moe_block: bool = False
    num_experts: int = 4
    top_k_experts: int = 2
    moe_intermediate_size: int = 32
    sliding_rope_theta: float = 10_000.0
    full_rope_theta: float = 1_000_000.0
    full_partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    # vision tower and image processor
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_layers: int = 2
    vision_num_heads: int = 2
    vision_head_dim: int = 16
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 256  # > the widest image's patches (3 x max_soft_tokens - 1)
    vision_clipped_linears: bool = True  # as E2B / E4B
    vision_standardize: bool = True  # as 31B / 26B-A4B
    max_soft_tokens: int = 70
    # audio tower. Its first conv channel count must stay 128 (the mel bins): transformers sizes the
    # input projection from it.
    with_audio: bool = True
    audio_hidden_size: int = 32
    audio_num_layers: int = 2
    audio_num_heads: int = 2
    audio_conv_channels: tuple[int, int] = (128, 8)
    audio_output_dims: int = 48
    # checkpoint
    tokenizer_vocab_size: int = 300
    vocab_size: int | None = None  # None: the tokenizer's size
    dtype: str = "float32"
    seed: int = 0


def _build_tokenizer(spec: TinyGemma4Spec) -> PreTrainedTokenizerFast:
    return gemma_tokenizer(spec.tokenizer_vocab_size, [*NAMED_TOKENS.values(), VIDEO_TOKEN], NAMED_TOKENS,
                           GEMMA4_CHAT_TEMPLATE)


def _build_config(spec: TinyGemma4Spec, tokenizer: PreTrainedTokenizerFast, initializer_range: float) -> Gemma4Config:
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    shared = gemma_text_config_args(spec, tokenizer, initializer_range)
    text = Gemma4TextConfig(
        **shared,
        vocab_size_per_layer_input=shared["vocab_size"],  # the per-layer table is indexed by token id
        # not fields in transformers 5.24: turned into per_layer_config for the full layers
        global_head_dim=spec.global_head_dim,
        num_global_key_value_heads=spec.num_global_key_value_heads,
        attention_k_eq_v=spec.attention_k_eq_v,
        use_bidirectional_attention=spec.use_bidirectional_attention,
        hidden_size_per_layer_input=spec.hidden_size_per_layer_input,
        num_kv_shared_layers=spec.num_kv_shared_layers,
        use_double_wide_mlp=spec.use_double_wide_mlp,
        enable_moe_block=spec.enable_moe_block,
        num_experts=spec.num_experts if spec.enable_moe_block else None,
        top_k_experts=spec.top_k_experts if spec.enable_moe_block else None,
        moe_intermediate_size=spec.moe_intermediate_size if spec.enable_moe_block else None,
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": spec.sliding_rope_theta},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": spec.full_partial_rotary_factor,
                   "rope_theta": spec.full_rope_theta},
        },
    )
    vision = Gemma4VisionConfig(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_hidden_layers=spec.vision_num_layers,
        num_attention_heads=spec.vision_num_heads,
        num_key_value_heads=spec.vision_num_heads,
        head_dim=spec.vision_head_dim,
        patch_size=spec.patch_size,
        pooling_kernel_size=spec.pooling_kernel_size,
        position_embedding_size=spec.position_embedding_size,
        use_clipped_linears=spec.vision_clipped_linears,
        standardize=spec.vision_standardize,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=initializer_range,
    )
    audio = Gemma4AudioConfig(
        hidden_size=spec.audio_hidden_size,
        num_hidden_layers=spec.audio_num_layers,
        num_attention_heads=spec.audio_num_heads,
        subsampling_conv_channels=list(spec.audio_conv_channels),
        output_proj_dims=spec.audio_output_dims,
        initializer_range=initializer_range,
    )
    ids = tokenizer.convert_tokens_to_ids
    return Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=audio if spec.with_audio else None,
        image_token_id=ids(NAMED_TOKENS["image_token"]),
        boi_token_id=ids(NAMED_TOKENS["boi_token"]),
        eoi_token_id=ids(NAMED_TOKENS["eoi_token"]),
        audio_token_id=ids(NAMED_TOKENS["audio_token"]),
        boa_token_id=ids(NAMED_TOKENS["boa_token"]),
        eoa_token_index=ids(NAMED_TOKENS["eoa_token"]),  # (sic: transformers' name)
        video_token_id=ids(VIDEO_TOKEN),
        tie_word_embeddings=True,
        initializer_range=initializer_range,
    )


def _perturb(model: torch.nn.Module) -> None:
    """The constants random_model's noise does not reach (buffers) and the vision position table
    (initialized to ones: every position alike) drawn off their init, under the build's seeded RNG."""
    import torch

    for name, tensor in model.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point():
            continue
        if name.endswith(("layer_scalar", "std_scale")):
            tensor.copy_(1.0 + 0.1 * torch.randn_like(tensor))
        elif name.endswith("std_bias"):
            tensor.copy_(0.1 * torch.randn_like(tensor))
        elif name.endswith("position_embedding_table"):
            tensor.copy_(TINY_INITIALIZER_RANGE * torch.randn_like(tensor))
        elif name.endswith(("input_min", "output_min")):  # clipped linears: finite, some values clip
            tensor.fill_(-4.0 - 4.0 * float(torch.rand(())))
        elif name.endswith(("input_max", "output_max")):
            tensor.fill_(4.0 + 4.0 * float(torch.rand(())))


def _build_processor(spec: TinyGemma4Spec, tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil

    from mmengine.models.gemma4_vision import processor_without_video_class

    image_processor = Gemma4ImageProcessorPil(
        max_soft_tokens=spec.max_soft_tokens, patch_size=spec.patch_size, pooling_kernel_size=spec.pooling_kernel_size
    )
    return processor_without_video_class()(
        Gemma4AudioFeatureExtractor(), image_processor, tokenizer,
        chat_template=GEMMA4_CHAT_TEMPLATE, image_seq_length=spec.max_soft_tokens,
    )


def _save_processor(processor: ProcessorMixin, path: pathlib.Path) -> None:
    """processor_config.json (the parts' settings nested), tokenizer files and chat_template.jinja, naming
    transformers' Gemma4Processor as the processor class (AutoProcessor resolves it with torchvision)."""
    processor.save_pretrained(path)
    for name in ("processor_config.json", "tokenizer_config.json"):
        update_json(path / name, processor_class="Gemma4Processor", sort_keys=True)


# The dense decoder at transformers' Gemma4TextConfig defaults (its docstring: "similar to
# google/gemma-4-e2b-it"): 30 layers of hidden 2304, five sliding (256-wide heads, window 512) to one global
# (512-wide heads), 8 query and 4 KV heads, 256-wide per-layer inputs, a 262144-token vocabulary; the vision
# tower at Gemma4VisionConfig's defaults (16 layers of 768), pictures attended both ways, up to 280 soft
# tokens. For GPU figures at a realistic scale (random bf16 weights); not an exact published checkpoint.
GEMMA4_DENSE_SPEC = TinyGemma4Spec(
    hidden_size=2304, intermediate_size=9216, layer_types=((SLIDING,) * 5 + (FULL,)) * 5, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=False,
    sliding_window=512, hidden_size_per_layer_input=256, num_kv_shared_layers=0, use_double_wide_mlp=False,
    final_logit_softcapping=30.0, max_position_embeddings=131072,
    vision_hidden_size=768, vision_intermediate_size=3072, vision_num_layers=16, vision_num_heads=12, vision_head_dim=64,
    position_embedding_size=10240, vision_clipped_linears=False, max_soft_tokens=280,
    with_audio=False, vocab_size=262144, dtype="bfloat16",
)


_BUILDER = FamilyBuilder(
    "gemma4", _BUILDER_VERSION, TinyGemma4Spec(), "Gemma4ForConditionalGeneration", _build_tokenizer, _build_config,
    lambda spec, tokenizer, path: _save_processor(_build_processor(spec, tokenizer), path),
    # as the published instruction-tuned checkpoints: a turn ends at <turn|>, a tool call at <|tool_response>
    eos_tokens=("<eos>", NAMED_TOKENS["eot_token"], NAMED_TOKENS["str_token"]), tweak=_perturb,
)
# A spec's random-weight checkpoint built into a path, and the path of its cached tiny checkpoint (FamilyBuilder)
build_gemma4_checkpoint = build_tiny_gemma4 = _BUILDER.build
tiny_gemma4_path = _BUILDER.path
