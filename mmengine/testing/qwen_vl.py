"""Random-weight Qwen2-VL and Qwen2.5-VL checkpoints for tests, demos and benchmarks.

Built locally with transformers' own classes (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`, the PIL `Qwen2VLImageProcessorPil`) and a locally trained tokenizer
carrying Qwen's special tokens; saved with `save_pretrained` in the layout of the published checkpoints
(config, generation config, safetensors, tokenizer, preprocessor config, chat template). No network.

- `build_tiny_qwen_vl` / `tiny_qwen_vl_path`: tiny shapes on CPU, weights scaled so that greedy parity
  between implementations is well defined (tests, the demo).
- `build_qwen_vl_checkpoint` with `QWEN2_5_VL_7B_SPEC`: the published model's shape, built directly on a
  GPU in bf16 at the real models' weight scale (benchmarks). Never commit one: it is 16 GB.

Without torchvision, transformers cannot build a Qwen-VL processor through `AutoProcessor` (it always
loads the torchvision-only video processor); `load_qwen_vl_processor` builds the same processor for
images only there, and is `AutoProcessor.from_pretrained` where torchvision is installed.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mmengine.models.qwen_video import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from mmengine.testing.cache import cached_build, spec_key
from mmengine.testing.checkpoint import save_checkpoint, text_config_args, write_json
from mmengine.testing.tokenizer import tiny_tokenizer
from mmengine.testing.weights import BUILD_DTYPES, REAL_INITIALIZER_RANGE, TINY_CONSTANT_NOISE, TINY_INITIALIZER_RANGE

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerFast, ProcessorMixin

__all__ = [
    "TinyQwenVLSpec",
    "QWEN2_5_VL_7B_SPEC",
    "QWEN3_VL_8B_SPEC",
    "QWEN3_5_9B_SPEC",
    "QWEN3_VL_30B_A3B_SPEC",
    "TINY_QWEN3_5_SPEC",
    "tiny_spec",
    "QWEN_CHAT_TEMPLATE",
    "build_qwen_vl_checkpoint",
    "build_tiny_qwen_vl",
    "tiny_qwen_vl_path",
    "load_qwen_vl_processor",
    "qwen_vl_prompt",
]

# Bump when the builder changes what it writes, so cached checkpoints are rebuilt.
_BUILDER_VERSION = 4  # 2: the chat template renders tools; 3: videos (template parts, video_preprocessor_config.json); 4: qwen3_5

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Families with Qwen3-VL's vision tower, image normalisation and video processor.
_QWEN3_VISION = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
_QWEN3_5 = ("qwen3_5", "qwen3_5_moe")  # the hybrid decoder
_DEEPSTACK = ("qwen3_vl", "qwen3_vl_moe")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
# In the published tokenizers' order (151643, 151644, 151645, then the vision tokens 151652, 151653,
# 151655, 151656); here they follow the small BPE vocabulary directly.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# Qwen's ChatML format, as in the published Qwen2-VL / Qwen2.5-VL templates but without the default
# system message:
#   <|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n
# `content` is a string or a list of {"type": "text", "text": ...} / {"type": "image"} parts (an "image"
# key also marks an image part, as transformers' chat templating passes images that way), in order.
# Tools as the published Qwen2.5 templates write them (Hermes style): their signatures in the system
# turn, an assistant's calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
QWEN_CHAT_TEMPLATE = r"""
{%- macro render(content) -%}
  {%- if content is string -%}{{ content }}
  {%- elif content is not none -%}
    {%- for part in content -%}
      {%- if part['type'] == 'image' or 'image' in part -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}
      {%- elif part['type'] == 'video' or 'video' in part -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}
      {%- elif part['type'] == 'text' -%}{{ part['text'] }}
      {%- else -%}{{ raise_exception('unsupported content part type: ' + part['type']) }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
  {{ '<|im_start|>system\n' }}
  {%- if messages[0]['role'] == 'system' -%}{{ render(messages[0]['content']) + '\n\n' }}{%- endif -%}
  {{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
  {%- for tool in tools -%}{{ '\n' + (tool | tojson) }}{%- endfor -%}
  {{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' and tools and loop.first -%}
  {%- elif message['role'] == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}
    {{ '\n<tool_response>\n' + render(message['content']) + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\n' }}{%- endif -%}
  {%- elif message['role'] == 'assistant' and message['tool_calls'] -%}
    {{ '<|im_start|>assistant' }}
    {%- if message['content'] -%}{{ '\n' + render(message['content']) }}{%- endif -%}
    {%- for call in message['tool_calls'] -%}
      {%- set call = call['function'] if call['function'] is defined else call -%}
      {{ '\n<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' + (call['arguments'] | tojson) + '}\n</tool_call>' }}
    {%- endfor -%}
    {{ '<|im_end|>\n' }}
  {%- else -%}
    {{ '<|im_start|>' + message['role'] + '\n' + render(message['content']) + '<|im_end|>\n' }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}
""".strip()


def qwen_vl_prompt(text: str, num_images: int = 0) -> str:
    """A one-turn user prompt in the chat template's format, its images first, ready for generation:
    what `apply_chat_template` renders for [image] * num_images + [text]."""
    images = f"{VISION_START}{IMAGE_PAD}{VISION_END}" * num_images
    return f"{IM_START}user\n{images}{text}{IM_END}\n{IM_START}assistant\n"


@dataclass(frozen=True)
class TinyQwenVLSpec:
    """Shape and family of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint; tiny by default (`QWEN2_5_VL_7B_SPEC` is
    a real shape). Equal specs built on the same device give byte-identical checkpoints.

    The text model's head_dim is hidden_size // num_attention_heads (as in Qwen2-VL), and `mrope_section`
    (temporal, height, width rotary frequencies) must sum to head_dim // 2. Images are resized to
    multiples of patch_size * spatial_merge_size with min_pixels <= h * w <= max_pixels; each becomes
    (h / patch) * (w / patch) / spatial_merge_size**2 tokens. `window_size` and `fullatt_block_indexes`
    are Qwen2.5-VL's window attention (in pixels; the layers that attend over the whole image).
    """

    family: str = "qwen2_5_vl"  # one of FAMILIES
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64  # Qwen2-VL: vision_hidden_size * mlp_ratio
    vision_num_heads: int = 2
    vision_depth: int | None = None  # None: 2 for qwen2_vl, 4 for qwen2_5_vl
    fullatt_block_indexes: tuple[int, ...] | None = None  # None: (1, 3) for qwen2_5_vl; qwen2_vl has none
    window_size: int = 56  # qwen2_5_vl only: 2x2 merged tokens (4x4 patches) a window
    patch_size: int | None = None  # None: 14, or 16 for qwen3_vl
    # qwen3_vl: the vision layers whose features DeepStack adds to the first decoder layers (one level
    # each), and the learned position grid (a square number of entries, interpolated to each image)
    deepstack_visual_indexes: tuple[int, ...] = (0, 2)
    num_position_embeddings: int = 64
    # qwen3_5: the hybrid decoder. Every `full_attention_interval`-th layer is gated full attention, the
    # others Gated DeltaNet with these heads; only `partial_rotary_factor` of each attention head rotates
    # (mrope_section then sums to the rotated half).
    full_attention_interval: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 1.0
    # qwen3_vl_moe / qwen3_5_moe: routed experts (top-k of num_experts, each an MLP of moe_intermediate_size)
    # in every layer but mlp_only_layers (qwen3_vl_moe), plus a gated shared expert (qwen3_5_moe)
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 48
    mlp_only_layers: tuple[int, ...] = ()
    # Qwen3 families write head_dim into the config: the published MoE shape's is not hidden / heads
    attention_head_dim: int | None = None
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    min_pixels: int = 28 * 28 * 4
    max_pixels: int = 28 * 28 * 64
    # The video processor's bounds in embeddings: per frame (Qwen2-VL, Qwen2.5-VL) or for all frames
    # together (Qwen3-VL, whose bounds are over the clip). None: 4..16 per frame, 8..64 per clip.
    video_tokens: tuple[int, int] | None = None
    tokenizer_vocab_size: int = 400  # target for BPE training
    # The model's vocabulary (embedding and lm_head rows). None: len(tokenizer) exactly. Larger pads it
    # past the tokenizer, as the published checkpoints do (152064 rows for 151665 tokens).
    vocab_size: int | None = None
    dtype: str = "float32"  # what build_tiny_qwen_vl / tiny_qwen_vl_path save
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.dtype not in BUILD_DTYPES:
            raise ValueError(f"dtype must be one of {BUILD_DTYPES}, got {self.dtype!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        rotary_half = int(self.head_dim * self.partial_rotary_factor) // 2
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != rotary_half:
            raise ValueError(
                f"mrope_section {self.mrope_section} must be three sections summing to the rotary half of the head "
                f"(head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} / 2 = {rotary_half})"
            )
        if self.attention_head_dim is not None and self.family not in _QWEN3_VISION:
            raise ValueError("attention_head_dim is for the Qwen3 families (Qwen2-VL's head_dim is hidden_size / heads)")
        if self.partial_rotary_factor != 1.0 and self.family not in _QWEN3_5:
            raise ValueError("partial_rotary_factor is Qwen3.5's (family qwen3_5 or qwen3_5_moe)")
        if self.vision_hidden_size % self.vision_num_heads or (self.vision_hidden_size // self.vision_num_heads) % 4:
            raise ValueError(
                f"vision_hidden_size {self.vision_hidden_size} / vision_num_heads {self.vision_num_heads} must be "
                "a multiple of 4 (the vision rotary embedding splits each head in height and width halves)"
            )
        if self.family == "qwen2_vl":
            if self.vision_intermediate_size % self.vision_hidden_size:
                raise ValueError(
                    f"qwen2_vl: vision_intermediate_size {self.vision_intermediate_size} must be a multiple of "
                    f"vision_hidden_size {self.vision_hidden_size} (Qwen2-VL's vision MLP has an integer mlp_ratio)"
                )
            if self.fullatt_block_indexes:
                raise ValueError("qwen2_vl has no window attention: fullatt_block_indexes must be None or empty")
        depth = self.vision_layers
        if self.family in _DEEPSTACK and (not self.deepstack_visual_indexes
                                          or any(not 0 <= i < depth for i in self.deepstack_visual_indexes)):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} must index the {depth} vision layers")
        if any(not 0 <= i < depth for i in self.full_attention_blocks):
            raise ValueError(f"fullatt_block_indexes {self.full_attention_blocks} must index the {depth} vision layers")
        factor = self.patch * self.spatial_merge_size
        if self.family == "qwen2_5_vl" and self.window_size % factor:
            raise ValueError(f"window_size {self.window_size} is not a multiple of patch_size * spatial_merge_size = {factor}")
        if not factor * factor <= self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"need {factor * factor} <= min_pixels <= max_pixels, got min_pixels={self.min_pixels}, "
                f"max_pixels={self.max_pixels}"
            )
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size <= 0):
            raise ValueError(f"vocab_size must be None or a positive int, got {self.vocab_size!r}")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def patch(self) -> int:
        """The effective patch size."""
        if self.patch_size is not None:
            return self.patch_size
        return 16 if self.family in _QWEN3_VISION else 14

    @property
    def vision_layers(self) -> int:
        """The effective vision depth."""
        if self.vision_depth is not None:
            return self.vision_depth
        return {"qwen2_vl": 2, "qwen2_5_vl": 4}.get(self.family, 3)

    @property
    def full_attention_blocks(self) -> tuple[int, ...]:
        """The effective fullatt_block_indexes (always empty for qwen2_vl, whose layers all attend fully)."""
        if self.fullatt_block_indexes is not None:
            return tuple(self.fullatt_block_indexes)
        return (1, 3) if self.family == "qwen2_5_vl" else ()

    @property
    def max_image_tokens(self) -> int:
        """The most tokens one image can become (an image at max_pixels)."""
        return self.max_pixels // (self.patch * self.spatial_merge_size) ** 2


# Qwen2.5-VL-7B-Instruct: a Qwen2 decoder (3584 hidden, 18944 MLP, 28 layers, 28 heads, 4 KV heads,
# head_dim 128, M-RoPE sections 16/24/24, 152064-row vocabulary, untied) over a 32-layer, 1280-wide
# window-attention ViT (16 heads, SiLU MLP 3420, full attention in layers 7/15/23/31, 112-pixel windows)
# and a patch merger to 3584. 8,292,166,656 parameters, like the published checkpoint; the tokenizer is
# the small built-in one, so text is noise.
QWEN2_5_VL_7B_SPEC = TinyQwenVLSpec(
    family="qwen2_5_vl",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    mrope_section=(16, 24, 24),
    rms_norm_eps=1e-6,
    max_position_embeddings=128000,
    vision_hidden_size=1280,
    vision_intermediate_size=3420,
    vision_num_heads=16,
    vision_depth=32,
    fullatt_block_indexes=(7, 15, 23, 31),
    window_size=112,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 1280,
    video_tokens=(128, 768),  # the published video_preprocessor_config.json
    vocab_size=152064,
    dtype="bfloat16",
)


# Qwen/Qwen3-VL-8B-Instruct's shape: a 36-layer Qwen3 decoder (4096 wide, 32 query / 8 KV heads of 128,
# interleaved M-RoPE sections 24/20/20, rope_theta 5e6, 151936-row vocabulary, untied) over a 27-layer,
# 1152-wide vision tower of 16 px patches with DeepStack levels from layers 8, 16 and 24; about 8.77B
# parameters. Image and video bounds as its published processor configs.
QWEN3_VL_8B_SPEC = TinyQwenVLSpec(
    family="qwen3_vl",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    mrope_section=(24, 20, 20),
    rope_theta=5_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    vision_hidden_size=1152,
    vision_intermediate_size=4304,
    vision_num_heads=16,
    vision_depth=27,
    deepstack_visual_indexes=(8, 16, 24),
    num_position_embeddings=2304,
    min_pixels=64 * 32 * 32,
    max_pixels=16384 * 32 * 32,
    video_tokens=(4, 24576),
    vocab_size=151936,
    dtype="bfloat16",
)


# A tiny Qwen3.5: four decoder layers (three Gated DeltaNet, then one gated attention layer), half of
# each attention head rotated with interleaved M-RoPE sections 2/1/1, Qwen3-VL's vision tower.
TINY_QWEN3_5_SPEC = TinyQwenVLSpec(family="qwen3_5", num_hidden_layers=4, mrope_section=(2, 1, 1), partial_rotary_factor=0.5)


# Qwen/Qwen3-VL-30B-A3B-Instruct's shape: a 48-layer MoE decoder (2048 wide, 32 query / 4 KV heads of 128,
# 128 experts of 768 in every layer, top-8), Qwen3-VL-8B's vision tower with DeepStack into 2048; about
# 31B parameters, ~3.3B active per token. Random bf16 weights: ~62 GB, one H100.
QWEN3_VL_30B_A3B_SPEC = replace(
    QWEN3_VL_8B_SPEC,  # the same vision tower, image and video bounds, rotary and vocabulary
    family="qwen3_vl_moe",
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    attention_head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
)


# Tiny MoE variants: 8 experts, top-2. Qwen3-VL-MoE's second layer keeps a dense MLP (mlp_only_layers), so
# both kinds of layer are exercised; Qwen3.5-MoE has experts and a gated shared expert in every layer.
TINY_QWEN3_VL_MOE_SPEC = TinyQwenVLSpec(family="qwen3_vl_moe", mlp_only_layers=(1,))
TINY_QWEN3_5_MOE_SPEC = TinyQwenVLSpec(family="qwen3_5_moe", num_hidden_layers=4, mrope_section=(2, 1, 1), partial_rotary_factor=0.5)


def tiny_spec(family: str) -> TinyQwenVLSpec:
    """The default tiny spec of a Qwen family (Qwen3.5's needs its own layer pattern and rotary split)."""
    specials = {"qwen3_5": TINY_QWEN3_5_SPEC, "qwen3_vl_moe": TINY_QWEN3_VL_MOE_SPEC, "qwen3_5_moe": TINY_QWEN3_5_MOE_SPEC}
    return specials.get(family) or TinyQwenVLSpec(family=family)


# Qwen/Qwen3.5-9B's shape: 32 decoder layers (24 Gated DeltaNet with 16 key / 32 value heads of 128 and a
# 4-wide conv; 8 gated attention layers, 16 query / 4 KV heads of 256, a quarter of each rotated, interleaved
# M-RoPE 11/11/10, rope_theta 1e7), 4096 wide, MLP 12288, 248320-row vocabulary; the vision tower as Qwen3-VL's
# (27 layers, 1152 wide, 16 px patches) without DeepStack. One recurrent state is 24 x (32 x 128 x 128 x 4 B +
# conv) ~ 48 MiB; the KV cache is 32 KiB a token.
QWEN3_5_9B_SPEC = replace(
    QWEN3_VL_8B_SPEC,  # the same vision tower (DeepStack unused), image and video bounds
    family="qwen3_5",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    mrope_section=(11, 11, 10),
    partial_rotary_factor=0.25,
    rope_theta=10_000_000.0,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    vocab_size=248320,
)


def _build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE wrapped as a transformers fast tokenizer, with Qwen's special tokens
    added after the learned vocabulary. As in Qwen's tokenizers there is no BOS, eos is <|im_end|> and
    padding is <|endoftext|>; padding is on the left, for batched generation."""
    return tiny_tokenizer(vocab_size, added_special_tokens=SPECIAL_TOKENS, eos_token=IM_END, pad_token=ENDOFTEXT)


def _build_config(
    spec: TinyQwenVLSpec, tokenizer: PreTrainedTokenizerFast, initializer_range: float | None = None
) -> PretrainedConfig:
    """The Qwen2VLConfig / Qwen2_5_VLConfig for `spec`, with the vocabulary and special ids taken from
    `tokenizer`. `initializer_range` None: the tiny checkpoints' scale (TINY_INITIALIZER_RANGE)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    if initializer_range is None:
        initializer_range = TINY_INITIALIZER_RANGE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text_config = dict(
        **text_config_args(spec, tokenizer, initializer_range, bos_token=ENDOFTEXT),
        hidden_act="silu",
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta, "mrope_section": list(spec.mrope_section)},
        use_sliding_window=False,
        max_window_layers=spec.num_hidden_layers,
    )
    common_vision = dict(
        depth=spec.vision_layers,
        num_heads=spec.vision_num_heads,
        in_channels=3,
        patch_size=spec.patch,
        temporal_patch_size=spec.temporal_patch_size,
        spatial_merge_size=spec.spatial_merge_size,
        initializer_range=initializer_range,
    )
    token_ids = dict(
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
    )
    # Qwen2.5-VL and Qwen3-VL: the ViT's widths and the merger's output (the decoder width)
    widths = dict(hidden_size=spec.vision_hidden_size, intermediate_size=spec.vision_intermediate_size,
                  out_hidden_size=spec.hidden_size)
    if spec.family == "qwen2_vl":
        # Qwen2-VL names the ViT width embed_dim and the merger's output (the decoder width) hidden_size.
        vision_config = dict(
            embed_dim=spec.vision_hidden_size,
            hidden_size=spec.hidden_size,
            mlp_ratio=spec.vision_intermediate_size // spec.vision_hidden_size,
            hidden_act="quick_gelu",
            **common_vision,
        )
        config_class = Qwen2VLConfig
    elif spec.family in _QWEN3_5:
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig

        for key in ("use_sliding_window", "max_window_layers"):
            text_config.pop(key)
        interval = spec.full_attention_interval
        text_config.update(
            head_dim=spec.head_dim,
            attention_bias=False,
            layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(spec.num_hidden_layers)],
            linear_num_key_heads=spec.linear_num_key_heads,
            linear_num_value_heads=spec.linear_num_value_heads,
            linear_key_head_dim=spec.linear_key_head_dim,
            linear_value_head_dim=spec.linear_value_head_dim,
            linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        )
        text_config["rope_parameters"] = {**text_config["rope_parameters"], "mrope_interleaved": True,
                                          "partial_rotary_factor": spec.partial_rotary_factor}
        if spec.family == "qwen3_5_moe":
            text_config.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                               moe_intermediate_size=spec.moe_intermediate_size,
                               shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
        vision_config = dict(hidden_act="gelu_pytorch_tanh", num_position_embeddings=spec.num_position_embeddings,
                             **common_vision, **widths)
        config_class = Qwen3_5MoeConfig if spec.family == "qwen3_5_moe" else Qwen3_5Config
    elif spec.family in _DEEPSTACK:
        from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

        text_config.update(head_dim=spec.head_dim, attention_bias=False)
        for key in ("use_sliding_window", "max_window_layers"):
            text_config.pop(key)
        # as the published checkpoints: interleaved M-RoPE sections (transformers always interleaves them)
        text_config["rope_parameters"] = {**text_config["rope_parameters"], "mrope_interleaved": True}
        vision_config = dict(
            hidden_act="gelu_pytorch_tanh",
            num_position_embeddings=spec.num_position_embeddings,
            deepstack_visual_indexes=list(spec.deepstack_visual_indexes),
            **common_vision,
            **widths,
        )
        config_class = Qwen3VLConfig
        if spec.family == "qwen3_vl_moe":
            text_config.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                               moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1,
                               mlp_only_layers=list(spec.mlp_only_layers))
            config_class = Qwen3VLMoeConfig
    else:
        vision_config = dict(
            hidden_act="silu",
            window_size=spec.window_size,
            fullatt_block_indexes=list(spec.full_attention_blocks),
            tokens_per_second=2,
            **common_vision,
            **widths,
        )
        config_class = Qwen2_5_VLConfig
    return config_class(
        text_config=text_config,
        vision_config=vision_config,
        tie_word_embeddings=spec.tie_word_embeddings,
        **token_ids,
    )


def _build_image_processor(spec: TinyQwenVLSpec):
    """Qwen2VLImageProcessorPil with the spec's pixel bounds. It is what Qwen2VLImageProcessor resolves to
    without torchvision and saves under that name, so where torchvision is installed AutoProcessor loads
    the torchvision backend with the same settings (same resize, same token counts)."""
    from transformers import Qwen2VLImageProcessorPil

    # Qwen3-VL normalizes with mean = std = 0.5 (its published preprocessor config)
    normalize = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if spec.family in _QWEN3_VISION else {}
    return Qwen2VLImageProcessorPil(
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        patch_size=spec.patch,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.spatial_merge_size,
        **normalize,
    )


def _processor_class(family: str) -> type[ProcessorMixin]:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    return {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}.get(family, Qwen3VLProcessor)


def _build_processor(spec: TinyQwenVLSpec, tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    """The family's processor (PIL image processor, tokenizer, chat template), images only."""
    from mmengine.models.qwen_vl import image_only_processor_class

    return image_only_processor_class(_processor_class(spec.family))(
        image_processor=_build_image_processor(spec), tokenizer=tokenizer, chat_template=QWEN_CHAT_TEMPLATE
    )


def _save_processor(spec: TinyQwenVLSpec, tokenizer: PreTrainedTokenizerFast, path: pathlib.Path) -> None:
    """Saves the processor's parts as the published checkpoints lay them out: tokenizer files, the image
    processor's preprocessor_config.json and chat_template.jinja. No processor_config.json: transformers
    resolves the processor class from config.json's model_type (or tokenizer_config.json's processor_class)."""
    image_processor = _build_image_processor(spec)
    tokenizer._processor_class = _processor_class(spec.family).__name__
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
    write_json(path / "video_preprocessor_config.json", _video_processor_settings(spec))


def _video_processor_settings(spec: TinyQwenVLSpec) -> dict[str, object]:
    """What transformers' Qwen2VLVideoProcessor / Qwen3VLVideoProcessor save, with the spec's bounds
    (by default tiny: 4..16 embeddings a frame for Qwen2-VL, 8..64 for all frames together for Qwen3-VL)."""
    qwen3 = spec.family in _QWEN3_VISION
    unit = spec.patch * spec.spatial_merge_size
    low, high = spec.video_tokens or ((8, 64) if qwen3 else (4, 16))
    mean, std = ([0.5] * 3, [0.5] * 3) if qwen3 else (list(OPENAI_CLIP_MEAN), list(OPENAI_CLIP_STD))
    return {
        "video_processor_type": "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": low * unit * unit, "longest_edge": high * unit * unit},
        "patch_size": spec.patch,
        "temporal_patch_size": spec.temporal_patch_size,
        "merge_size": spec.spatial_merge_size,
        "image_mean": mean,
        "image_std": std,
        "do_sample_frames": qwen3,
        "fps": 2.0,
        "min_frames": 4,
        "max_frames": 64,
    }


def load_qwen_vl_processor(path: str | os.PathLike) -> ProcessorMixin:
    """The checkpoint's processor, loaded as the engine loads it: `AutoProcessor` where torchvision is
    installed, else the family's processor class without its torchvision-only video processor."""
    from transformers import AutoConfig

    from mmengine.models.registry import load_hf_processor

    family = AutoConfig.from_pretrained(path).model_type
    if family not in FAMILIES:
        raise ValueError(f"{path} is not a Qwen2-VL / Qwen2.5-VL checkpoint (model_type {family!r})")
    return load_hf_processor(pathlib.Path(path))


def build_qwen_vl_checkpoint(
    path: str | os.PathLike,
    spec: TinyQwenVLSpec = TinyQwenVLSpec(),
    *,
    device: str = "cpu",
    dtype: torch.dtype | str | None = None,
    initializer_range: float = REAL_INITIALIZER_RANGE,
    constant_noise: float = 0.0,
    max_shard_size: str | None = None,
    tweak: Callable[[torch.nn.Module], None] | None = None,
) -> pathlib.Path:
    """Builds a random-weight checkpoint of `spec` and saves it (weights, config, generation config,
    tokenizer, image processor, chat template) into `path`; returns the path.

    The weights are created directly on `device` in `dtype` (None: `spec.dtype`), drawn with transformers'
    own initialization at `initializer_range` (0.02, the real models' scale) from seed `spec.seed`, plus
    `constant_noise` on the parameters it sets to constants (see weights.random_model). On a
    GPU the Qwen2.5-VL-7B shape takes about 16 GB:

        build_qwen_vl_checkpoint(path, QWEN2_5_VL_7B_SPEC, device="cuda")

    `max_shard_size` (e.g. "200KB") makes a sharded safetensors checkpoint (model.safetensors.index.json).
    """
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    model_class = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
                   "qwen3_vl": Qwen3VLForConditionalGeneration, "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
                   "qwen3_5": Qwen3_5ForConditionalGeneration, "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration}[spec.family]
    tokenizer = _build_tokenizer(spec.tokenizer_vocab_size)
    return save_checkpoint(
        path, model_class, _build_config(spec, tokenizer, initializer_range), tokenizer,
        lambda path: _save_processor(spec, tokenizer, path), seed=spec.seed, device=device,
        dtype=spec.dtype if dtype is None else dtype,
        # as the published Instruct checkpoints: a turn ends at <|im_end|>, a document at <|endoftext|>
        eos_tokens=(IM_END, ENDOFTEXT), bos_token=ENDOFTEXT, constant_noise=constant_noise, max_shard_size=max_shard_size,
        tweak=tweak,
    )


def build_tiny_qwen_vl(
    path: str | os.PathLike, spec: TinyQwenVLSpec = TinyQwenVLSpec(), *, max_shard_size: str | None = None
) -> pathlib.Path:
    """Builds and saves a tiny test checkpoint (on CPU, in `spec.dtype`, weights at the parity-friendly
    scale explained at TINY_INITIALIZER_RANGE, constants perturbed by TINY_CONSTANT_NOISE); returns the path."""
    return build_qwen_vl_checkpoint(
        path,
        spec,
        device="cpu",
        initializer_range=TINY_INITIALIZER_RANGE,
        constant_noise=TINY_CONSTANT_NOISE,
        max_shard_size=max_shard_size,
        tweak=_slow_recurrent_decay if spec.family in _QWEN3_5 else None,
    )


def _slow_recurrent_decay(model: torch.nn.Module) -> None:
    """Gated DeltaNet layers with A drawn from U(0.02, 0.3) instead of transformers' U(0.01, 16): at random
    weights a large A forgets every token at once, so every prompt ending in the chat template's tail
    continued alike and a parity test could not tell a state carried across steps from a lost one."""
    for name, param in model.named_parameters():
        if name.endswith("linear_attn.A_log"):
            param.copy_(param.new_empty(param.shape).uniform_(0.02, 0.3).log())


def tiny_qwen_vl_path(spec: TinyQwenVLSpec = TinyQwenVLSpec(), cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The path of a cached tiny checkpoint for `spec`, building it on first use (cache dir as for
    tiny_llava_path: $MMENGINE_CACHE_DIR or ~/.cache/mmengine/tiny-models)."""
    name = f"{spec.family}-{spec_key(spec, _BUILDER_VERSION)}"
    return cached_build(name, lambda path: build_tiny_qwen_vl(path, spec), cache_dir)
