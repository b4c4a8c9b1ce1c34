"""What one tensor-parallel rank holds, from a checkpoint's headers and config alone (`mmengine budget
--tensor-parallel-size N [--enable-expert-parallel]`): its weights (the decoder's projections, embedding and LM head
split as `sharded_model.py` splits them, everything else whole on every rank) and its KV cache per token. The
routed experts: every expert's share of the intermediate rows, or with expert parallelism rank 0's E/N experts
whole (the other ranks hold as many).

A decoder tensor is told from the vision side's by its name (under a `language_model`, or a text-only
checkpoint's `model.layers`/`model.embed_tokens`/`lm_head`, never under a vision tower or projector).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mmengine.distributed.sharding import kv_head_split, routed_experts
from mmengine.distributed.vocab_parallel import padded_vocab_size

_PROJECTION = re.compile(r"layers\.\d+\..*\b(q|k|v|o|gate|up|down)_proj\.(weight|bias)$")  # (shared and per-expert ones too)
# Gated DeltaNet (Qwen3.5): everything but the gated norm is split by heads
_LINEAR_ATTENTION = re.compile(r"linear_attn\.(?:(?:in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|conv1d|out_proj)\.weight|dt_bias|A_log)$")
_VISION_MARKERS = ("vision", "visual", "projector", "multi_modal")
# One routed expert's tensor stored apart (any part: a quantized one's scales too), and the fused ones
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


@dataclass(frozen=True)
class RankShare:
    """Elements of a checkpoint: in all (`whole`), on one rank (`per_rank`), and of those the replicated ones."""

    whole: int
    per_rank: int
    replicated: int


def is_decoder_tensor(name: str) -> bool:
    if any(marker in name for marker in _VISION_MARKERS):
        return False
    return "language_model" in name or name.startswith(("model.layers.", "model.embed_tokens", "lm_head"))


def is_routed_expert(name: str) -> bool:
    return is_decoder_tensor(name) and (_PER_EXPERT.search(name) is not None or name.endswith(_FUSED_EXPERTS))


def rank_elements(name: str, shape: tuple[int, ...], text_config: object, tp_size: int, expert_parallel: bool = False,
                  rank: int = 0) -> int:
    """Elements of checkpoint tensor `name` rank `rank` holds (`expert_parallel`: whole experts per rank)."""
    numel = math.prod(shape)
    if tp_size == 1 or not is_decoder_tensor(name):
        return numel
    if expert_parallel and is_routed_expert(name):
        stored_apart = _PER_EXPERT.search(name)
        if stored_apart is None:
            return numel // tp_size  # a fused tensor: this rank's E/N experts
        num_experts = routed_experts(text_config)
        per_rank = num_experts // tp_size
        return numel if rank * per_rank <= int(stored_apart[1]) < (rank + 1) * per_rank else 0
    if name.endswith(("embed_tokens.weight", "lm_head.weight", "embed_tokens_per_layer.weight")):
        return padded_vocab_size(shape[0], tp_size) // tp_size * math.prod(shape[1:])
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")) or _LINEAR_ATTENTION.search(name):
        return numel // tp_size  # every expert's intermediate rows; a linear-attention layer's heads
    match = _PROJECTION.search(name)
    if match is None:
        return numel  # norms
    projection, kind = match.groups()
    if projection in ("k", "v"):
        heads = text_config.num_key_value_heads
        return numel * kv_head_split(heads, tp_size).heads_per_rank // heads
    if projection in ("o", "down") and kind == "bias":
        return numel  # added once, held by every rank
    return numel // tp_size


def rank_share(shapes: dict[str, tuple[int, ...]], text_config: object, tp_size: int, expert_parallel: bool = False) -> RankShare:
    """Rank 0's elements (with expert parallelism each rank holds as many, of other experts)."""
    whole = per_rank = replicated = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        held = rank_elements(name, shape, text_config, tp_size, expert_parallel)
        whole += numel
        per_rank += held
        replicated += held if held == numel and tp_size > 1 and not (expert_parallel and is_routed_expert(name)) else 0
    return RankShare(whole, per_rank, replicated)


def routed_expert_share(shapes: dict[str, tuple[int, ...]], text_config: object, tp_size: int,
                        expert_parallel: bool = False) -> RankShare:
    """The routed experts' elements alone: in all and on rank 0 (`replicated` is 0: every expert is split)."""
    experts = {name: shape for name, shape in shapes.items() if is_routed_expert(name)}
    share = rank_share(experts, text_config, tp_size, expert_parallel)
    return RankShare(share.whole, share.per_rank, 0)


def rank_kv_layout(layout: list[tuple[int, int]], tp_size: int) -> list[tuple[int, int]]:
    """(KV heads, head size) per cached layer on one rank: the heads split, or one replicated head."""
    return [(kv_head_split(heads, tp_size).heads_per_rank, size) for heads, size in layout]


# A quantized checkpoint's parts: the int32 words of 8 int4 values, and the small tensors beside each weight
_PACKED_PARTS = ("qweight", "weight_packed")
_SIDE_PARTS = ("qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape",
               "input_scale", "k_scale", "v_scale")
_QUANTIZED_PARTS = (*_PACKED_PARTS, *_SIDE_PARTS)
_STORED_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "I16": 2, "F16": 2, "BF16": 2, "I32": 4, "F32": 4, "I64": 8}


@dataclass(frozen=True)
class QuantizedRankShare:
    """Rank 0's part of a quantized checkpoint: bytes with its projections kept quantized (the fused kernels' path:
    each rank keeps its slice's bits, scales and zeros), its parameters, and bytes dequantized at load."""

    kept_bytes: int
    parameters: int
    dequantized_bytes: int


def quantized_rank_share(headers: dict[str, tuple[tuple[int, ...], str]], text_config: object, tp_size: int, elem: int,
                         expert_parallel: bool = False) -> QuantizedRankShare:
    """Each quantized part split as its weight is (`rank_elements` of the owner's `.weight` rule: a projection's rows or
    columns, a KV projection's heads, an expert's share); float tensors in the model's dtype (`elem` bytes), the
    quantized ones as stored. Scales and zeros are counted split with their weight: a rank that keeps finer scales
    (an input split cutting a block) holds a little more."""
    kept = parameters = 0
    for name, (shape, dtype) in headers.items():
        owner, _, leaf = name.rpartition(".")
        rule = f"{owner}.weight" if leaf in _QUANTIZED_PARTS else name
        held = rank_elements(rule, shape, text_config, tp_size, expert_parallel)
        if leaf in _PACKED_PARTS:
            parameters += held * 8
        elif leaf not in _SIDE_PARTS:
            parameters += held
        float_value = dtype in ("F16", "BF16", "F32") and leaf not in _SIDE_PARTS
        kept += held * (elem if float_value else _STORED_BYTES.get(dtype, elem))
    return QuantizedRankShare(kept, parameters, parameters * elem)
