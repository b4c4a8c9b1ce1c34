"""Random-weight Gemma 3 (`Gemma3ForConditionalGeneration`) checkpoints for tests.

Built locally with transformers' own classes (Gemma3Config with a SigLIP vision config, the PIL
`Gemma3ImageProcessorPil`, `Gemma3Processor`) and a locally trained tokenizer carrying Gemma 3's
named special tokens (`<start_of_image>`, `<image_soft_token>`, `<end_of_image>`, the turn markers);
saved with `save_pretrained` (config, generation config, safetensors, tokenizer, processor settings,
chat template). transformers reloads the model with `Gemma3ForConditionalGeneration.from_pretrained`
and the processor with `AutoProcessor`, without torchvision.

The default spec has five sliding layers to one global and one more sliding after it, a window of 8
(smaller than a picture's 16 soft tokens), a query scale that is not the head size's, linear RoPE
scaling on the global layers (as the 4B-27B releases) and norm weights drawn off their zero init, so
an implementation that drops one shows in a parity test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmengine.testing.checkpoint import text_config_args, vision_sizes
from mmengine.testing.family_builder import FamilyBuilder
from mmengine.testing.tokenizer import tiny_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import Gemma3Config, PreTrainedTokenizerFast, ProcessorMixin

__all__ = ["TinyGemma3Spec", "GEMMA3_4B_SPEC", "GEMMA3_CHAT_TEMPLATE", "build_tiny_gemma3", "build_gemma3_checkpoint",
           "tiny_gemma3_path", "gemma3_prompt"]

# Bump when the builder changes what it writes, so cached checkpoints are rebuilt.
_BUILDER_VERSION = 1

SLIDING, FULL = "sliding_attention", "full_attention"

_EMBEDDING_SCALE = 0.1

# Ids 0..4 as in Gemma's vocabulary (Gemma3TextConfig's pad 0, eos 1, bos 2).
LEADING_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
# The named special tokens Gemma3Processor reads from the tokenizer (as the published tokenizer_config has them)
NAMED_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}

# Gemma 3's turn format (the published template also folds a system message into the first user turn):
#   <bos><start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<start_of_image>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] | trim -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


def gemma3_prompt(text: str, num_images: int = 0) -> str:
    """A one-turn user prompt with `num_images` image markers before the text, as the template writes them."""
    return "<bos><start_of_turn>user\n" + "<start_of_image>" * num_images + text + "<end_of_turn>\n<start_of_turn>model\n"


@dataclass(frozen=True)
class TinyGemma3Spec:
    # decoder
    hidden_size: int = 64
    intermediate_size: int = 128
    layer_types: tuple[str, ...] = (SLIDING,) * 5 + (FULL, SLIDING)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    query_pre_attn_scalar: int = 24
    sliding_window: int = 8
    sliding_rope_theta: float = 10_000.0
    full_rope_theta: float = 1_000_000.0
    full_rope_linear_factor: float | None = 8.0  # None: plain RoPE on the global layers too (as the 1B)
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    # SigLIP vision tower, projector and image processor
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_layers: int = 2
    vision_num_heads: int = 2
    image_size: int = 64
    patch_size: int = 8
    mm_tokens_per_image: int = 16  # a 4x4 average pool over the 8x8 patches
    do_pan_and_scan: bool = False
    # checkpoint
    tokenizer_vocab_size: int = 300
    vocab_size: int | None = None  # None: the tokenizer's size
    dtype: str = "float32"
    seed: int = 0


def gemma_tokenizer(
    vocab_size: int, added_special_tokens: Sequence[str], named_tokens: dict[str, str], chat_template: str
) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE with Gemma's LEADING_TOKENS, then `added_special_tokens`, as a transformers
    fast tokenizer; `named_tokens` become named attributes (tokenizer.boi_token, tokenizer.image_token_id, ...).
    No BOS is added when encoding: the chat template writes it. (Gemma 3's and Gemma 4's.)"""
    return tiny_tokenizer(
        vocab_size, leading_special_tokens=LEADING_TOKENS, added_special_tokens=added_special_tokens,
        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
        extra_special_tokens=dict(named_tokens), add_bos_token=False, chat_template=chat_template,
    )


# The decoder sizes Gemma 3's and Gemma 4's specs name alike (their layer count is len(layer_types))
GEMMA_DECODER_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "sliding_window", "final_logit_softcapping", "max_position_embeddings", "rms_norm_eps")


def gemma_text_config_args(spec: object, tokenizer: PreTrainedTokenizerFast, initializer_range: float) -> dict[str, Any]:
    """Gemma 3's and Gemma 4's text config arguments read alike off their specs: checkpoint.text_config_args over
    the GEMMA_DECODER_SIZES, and the layer types (and so the layer count)."""
    return text_config_args(spec, tokenizer, initializer_range, sizes=GEMMA_DECODER_SIZES) | dict(
        num_hidden_layers=len(spec.layer_types), layer_types=list(spec.layer_types))


def _build_tokenizer(spec: TinyGemma3Spec) -> PreTrainedTokenizerFast:
    return gemma_tokenizer(spec.tokenizer_vocab_size, [*TURN_TOKENS, *NAMED_TOKENS.values()], NAMED_TOKENS,
                           GEMMA3_CHAT_TEMPLATE)


def _build_config(spec: TinyGemma3Spec, tokenizer: PreTrainedTokenizerFast, initializer_range: float) -> Gemma3Config:
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    full_rope = {"rope_type": "default", "rope_theta": spec.full_rope_theta}
    if spec.full_rope_linear_factor is not None:
        full_rope = {"rope_type": "linear", "factor": spec.full_rope_linear_factor, "rope_theta": spec.full_rope_theta}
    text = Gemma3TextConfig(
        **gemma_text_config_args(spec, tokenizer, initializer_range),
        query_pre_attn_scalar=spec.query_pre_attn_scalar,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": spec.sliding_rope_theta}, FULL: full_rope},
    )
    vision = SiglipVisionConfig(
        **vision_sizes(spec),
        layer_norm_eps=1e-6,
        vision_use_head=False,  # as the published checkpoints: Gemma 3 reads the post-normed patch states
    )
    ids = tokenizer.convert_tokens_to_ids
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=spec.mm_tokens_per_image,
        boi_token_index=ids(NAMED_TOKENS["boi_token"]),
        eoi_token_index=ids(NAMED_TOKENS["eoi_token"]),
        image_token_index=ids(NAMED_TOKENS["image_token"]),
        initializer_range=initializer_range,
        tie_word_embeddings=True,
    )


def _shrink_embeddings(model: torch.nn.Module) -> None:
    """The tied embeddings scaled down (x0.1): at the parity-friendly init each token's own embedding,
    times sqrt(hidden), outweighs what the layers add, so greedy decoding repeats the last token; smaller,
    the tokens depend on the whole prompt and the pictures."""
    model.model.language_model.embed_tokens.weight.mul_(_EMBEDDING_SCALE)


def _build_processor(spec: TinyGemma3Spec, tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    # The published preprocessor settings at this tower's input size: bilinear resize to a square,
    # mean and std 0.5, pan-and-scan off unless the spec turns it on (then its published defaults)
    pan_and_scan = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=32, pan_and_scan_max_num_crops=4,
                        pan_and_scan_min_ratio_to_activate=1.2) if spec.do_pan_and_scan else {}
    image_processor = Gemma3ImageProcessorPil(
        size={"height": spec.image_size, "width": spec.image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3, **pan_and_scan,
    )
    return Gemma3Processor(image_processor, tokenizer, chat_template=GEMMA3_CHAT_TEMPLATE, image_seq_length=spec.mm_tokens_per_image)


# Gemma 3 4B's shapes (transformers' Gemma3TextConfig defaults are close to them): 34 layers of hidden 2560, five
# sliding (window 1024) to one global, 8 query and 4 KV heads of 256, linear RoPE x8 on the global layers, a
# 262208-token vocabulary; SigLIP-So400m at 896 px (27 layers of 1152, patches of 14), 256 soft tokens. For GPU
# figures at a realistic scale (random bf16 weights); not an exact published checkpoint.
GEMMA3_4B_SPEC = TinyGemma3Spec(
    hidden_size=2560, intermediate_size=10240, layer_types=((SLIDING,) * 5 + (FULL,)) * 5 + (SLIDING,) * 4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
    max_position_embeddings=131072, vision_hidden_size=1152, vision_intermediate_size=4304, vision_num_layers=27,
    vision_num_heads=16, image_size=896, patch_size=14, mm_tokens_per_image=256, vocab_size=262208, dtype="bfloat16",
)


_BUILDER = FamilyBuilder(
    "gemma3", _BUILDER_VERSION, TinyGemma3Spec(), "Gemma3ForConditionalGeneration", _build_tokenizer, _build_config,
    lambda spec, tokenizer, path: _build_processor(spec, tokenizer).save_pretrained(path),
    # as the published instruction-tuned checkpoints: a turn ends at <eos> or <end_of_turn>
    eos_tokens=("<eos>", "<end_of_turn>"), tweak=_shrink_embeddings,
)
# A spec's random-weight checkpoint built into a path, and the path of its cached tiny checkpoint (FamilyBuilder)
build_gemma3_checkpoint = build_tiny_gemma3 = _BUILDER.build
tiny_gemma3_path = _BUILDER.path
