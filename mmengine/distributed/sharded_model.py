"""A model family's model split over the tensor-parallel ranks, and its weights read shard by shard.

The model is built as the family builds it (its parameters on meta, so nothing is allocated whole), then the
decoder's layers are swapped for the parallel ones of this rank, and only then given storage:

```
language_model.embed_tokens          VocabParallelEmbedding   rows of this rank's vocabulary, all-reduce
layers.i.self_attn.qkv_proj          QKVParallelLinear        q heads split; KV heads split or replicated
layers.i.self_attn.o_proj            RowParallelLinear        all-reduce, bias once
layers.i.mlp.gate_up_proj            MergedColumnParallel     gate and up each split
layers.i.mlp.down_proj               RowParallelLinear        all-reduce
layers.i.mlp.experts (MoE)           ParallelFusedExperts     every expert's intermediate rows split, all-reduce
  with enable_expert_parallel        ExpertParallelFusedExperts  this rank's E/tp experts whole, all-reduce
lm_head                              ParallelLMHead           all-gather of the logits (every rank samples)
the vision tower, projector, norms   replicated               read whole
mtp.* (Qwen3.5's MTP head)           as a decoder layer       fc column-parallel, gathered (sharded_draft_heads.py)
```

On a quantized checkpoint with the fused kernels on, the decoder's projections and SiLU experts keep the rank's slice
of the checkpoint's bits instead, in TP 1's quantized layers (quantized_parallel.py).

`check_tensor_parallel_shapes` says, from the config alone and before any process starts, whether the
decoder can be split: a ConfigError naming the field (num_attention_heads, num_key_value_heads,
intermediate_size, moe_intermediate_size, or num_experts with enable_expert_parallel) and tensor_parallel_size, or
one naming what is not split yet.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmengine.distributed.checkpoint_slices import CheckpointSlices, load_parameter, target_of
from mmengine.distributed.parallel_experts import expert_range
from mmengine.distributed.parallel_lora import enable_parallel_lora
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.distributed.quantized_parallel import RankQuantizedLoad, deferred_weights, use_rank_quantized_weights
from mmengine.distributed.quantized_slices import quantized_weight_slices
from mmengine.distributed.sharded_draft_heads import build_eagle3_head, shard_mtp_head
from mmengine.distributed.sharded_layers import shard_attention, shard_layer_mlp, split_mlp
from mmengine.distributed.sharded_update import update_sharded_weights
from mmengine.distributed.sharding import divide, kv_head_split, routed_experts
from mmengine.distributed.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from mmengine.errors import ConfigError, WeightsMismatchError
from mmengine.models.family import ModelFamily
from mmengine.models.llama import DecoderAttention, head_dim_of
from mmengine.models.loader import WeightCheck, materialize_parameters, parameters_on_meta
from mmengine.models.quantization import quantization_of
from mmengine.models.vlm import KV_SCALE_NAME

# The decoders this module splits (their families' model_class.decoder_class), by module and class name: the split
# of a family's decoder is imported for that family alone, so a rank (and the driver's check) imports only the family
# it runs, not every family's decoder (Qwen3.5's pulls Qwen-VL's preprocessing modules)
DENSE, HYBRID = "mmengine.models.llama.DecoderModel", "mmengine.models.qwen3_5_model.HybridDecoderModel"
GEMMA3, GEMMA4 = "mmengine.models.gemma3_text.Gemma3DecoderModel", "mmengine.models.gemma4_text.Gemma4DecoderModel"
LLAMA4 = "mmengine.models.llama4_text.Llama4DecoderModel"
SPLIT_DECODERS = (DENSE, HYBRID, GEMMA3, GEMMA4, LLAMA4)


def decoder_kind(decoder_class: Any) -> str:
    """A decoder class's module and name (what SPLIT_DECODERS holds); "" for anything but a class."""
    return f"{decoder_class.__module__}.{decoder_class.__qualname__}" if isinstance(decoder_class, type) else ""
# One expert's projection stored apart (Qwen3.5-MoE's layout), by our name
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# Any part of one expert's projection stored apart (a quantized one's weight, scales, zeros), by our name
_PER_EXPERT_PART = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.\w+$")
# An FP8-KV checkpoint's per-layer scales, by our name (as models/vlm.py reads them)


def check_tensor_parallel_shapes(family: ModelFamily, tp_size: int, expert_parallel: bool = False) -> None:
    """Raises a ConfigError when the family's decoder cannot be split over `tp_size` ranks (before any rank
    starts): a size that does not divide, or a decoder kind that is not split yet. `expert_parallel`: whole experts
    per rank, which needs a decoder with experts, as many on every rank."""
    config = family.text_config
    name = family.display_name or type(family).__name__
    experts = routed_experts(config)
    if expert_parallel:
        if tp_size == 1:
            raise ConfigError("enable_expert_parallel needs tensor_parallel_size > 1 (the experts are split over its ranks)")
        if not experts:
            raise ConfigError(f"enable_expert_parallel: {name}'s decoder has no experts (num_experts is not set: a dense "
                              "model); leave enable_expert_parallel off")
        expert_range(experts, tp_size, 0)
    if tp_size == 1:
        return
    if family.recurrent_shape is not None:  # the Gated DeltaNet layers split by their heads
        from mmengine.distributed.sharded_hybrid import rank_shape

        rank_shape(family.recurrent_shape, tp_size)
    decoder_class = getattr(type(family).model_class, "decoder_class", None)
    if decoder_kind(decoder_class) not in SPLIT_DECODERS:
        raise ConfigError(f"tensor_parallel_size={tp_size}: {name}'s decoder ({getattr(decoder_class, '__name__', decoder_class)}) "
                          "is not split over ranks yet; run it with tensor_parallel_size=1")
    divide(config.num_attention_heads, tp_size, "the text model", "num_attention_heads")
    for heads in {heads for heads, _ in family.kv_cache_layout()}:  # (Gemma 4's global layers have KV heads of their own)
        kv_head_split(heads, tp_size, "the text model")
    divide(config.intermediate_size, tp_size, "the text model", "intermediate_size")
    if getattr(config, "intermediate_size_mlp", None):  # Llama 4's dense layers
        divide(config.intermediate_size_mlp, tp_size, "the text model", "intermediate_size_mlp")
    if getattr(config, "num_experts", 0) and not expert_parallel:  # the experts split on their intermediate size
        divide(config.moe_intermediate_size, tp_size, "the text model", "moe_intermediate_size")


def tensor_parallel_family(family: ModelFamily, tp: TensorParallelGroup, expert_parallel: bool = False) -> ModelFamily:
    """The family as one rank sees it: its model built split (`model_class`; `expert_parallel`: whole experts per
    rank), and the KV cache of this rank's KV heads (`kv_cache_layout`)."""
    check_tensor_parallel_shapes(family, tp.size, expert_parallel)
    base = type(family)
    layout = [(kv_head_split(heads, tp.size).heads_per_rank, head_size) for heads, head_size in family.kv_cache_layout()]
    recurrent = family.recurrent_shape
    ranked_recurrent = None
    if recurrent is not None:
        from mmengine.distributed.sharded_hybrid import rank_shape

        ranked_recurrent = rank_shape(recurrent, tp.size)
    draft_layers = family.num_draft_layers
    ranked_class = type(f"TensorParallel{base.__name__}", (base,), {
        "kv_cache_layout": lambda self: list(layout),
        "recurrent_shape": property(lambda self: ranked_recurrent),
        "model_class": staticmethod(lambda hf_config: build_sharded_model(base.model_class, hf_config, tp, expert_parallel,
                                                                          draft_layers)),
        # an EAGLE-3 head (runner/head_drafter.py's Eagle3DraftHead) split as the decoder is
        "build_eagle3_head": staticmethod(lambda config, hidden, own, model_dir, device, dtype: build_eagle3_head(
            config, hidden, own, model_dir, tp, device, dtype)),
    })
    ranked = copy.copy(family)
    ranked.__class__ = ranked_class
    return ranked


def build_sharded_model(model_class: Callable[[Any], nn.Module], hf_config: Any, tp: TensorParallelGroup,
                        expert_parallel: bool = False, draft_layers: int = 0) -> nn.Module:
    """The family's model with this rank's parallel layers, given storage on the current default device and
    dtype (the runner builds it under both); `load_weights` then reads this rank's slices. `draft_layers`: the
    MTP head's layers, built and split with the decoder (its later `enable_mtp` then has nothing to do)."""
    with parameters_on_meta():
        model = model_class(hf_config)
        if draft_layers:
            model.enable_mtp(draft_layers)
    expected = model.expected_weights()  # the checkpoint's whole shapes, before the split
    shard_decoder(model, tp, expert_parallel)
    if draft_layers:
        shard_mtp_head(model, tp, expert_parallel)
        model.enable_mtp = lambda num_layers: None  # type: ignore[method-assign]
    device = torch.get_default_device()  # (the runner's; under its parameters_on_meta the layers' weights are on meta)
    # a quantized checkpoint's projections stay on meta where built so (the runner's parameters_on_meta: the fused
    # kernels run): the rank keeps its slices quantized (quantized_parallel.py)
    deferred = deferred_weights(model) if quantization_of(hf_config) is not None else set()
    materialize_parameters(model, device, keep_meta=deferred.__contains__)
    model.defer_quantizable_weights = lambda device: None  # type: ignore[method-assign]
    model.load_weights = lambda weights, quantization=None, packed=None: load_sharded_weights(  # type: ignore[method-assign]
        model, Path(weights.model_dir), expected, packed)
    model.use_quantized_weights = lambda packed: use_rank_quantized_weights(model, packed)  # type: ignore[method-assign]

    model.update_weights = lambda weights, loaded: update_sharded_weights(model, weights, loaded, expected)  # type: ignore[method-assign]
    decoder = model.language_model
    decoder.enable_lora = lambda max_loras, max_rank: enable_parallel_lora(decoder, tp, max_loras, max_rank)  # type: ignore[method-assign]
    return model


def shard_decoder(model: nn.Module, tp: TensorParallelGroup, expert_parallel: bool = False) -> None:
    """Swaps the decoder's embedding, projections and LM head for this rank's parallel layers (the experts on their
    intermediate size, or with `expert_parallel` this rank's whole experts)."""
    decoder = model.language_model
    kind = decoder_kind(type(decoder))
    if kind not in SPLIT_DECODERS:
        raise ConfigError(f"tensor parallelism: the decoder {type(decoder).__name__} is not split over ranks yet")
    config = decoder.config
    hidden = config.hidden_size
    if kind in (GEMMA3, GEMMA4):
        from mmengine.distributed.sharded_gemma import shard_gemma_decoder

        shard_gemma_decoder(decoder, tp, expert_parallel)
        model.lm_head = ParallelLMHead(config.vocab_size, hidden, tp=tp, name="lm_head")
        return
    if kind == LLAMA4:
        from mmengine.distributed.sharded_llama4 import shard_llama4_decoder

        decoder.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp=tp, name="language_model.embed_tokens")
        shard_llama4_decoder(decoder, tp, split_mlp, expert_parallel)
        model.lm_head = ParallelLMHead(config.vocab_size, hidden, tp=tp, name="lm_head")
        return
    hybrid = kind == HYBRID
    if hybrid:  # Qwen3.5's layers: Gated DeltaNet or gated attention, split by their heads
        from mmengine.distributed.sharded_hybrid import shard_gated_attention, shard_gated_delta_net
        from mmengine.layers.gated_delta import GatedDeltaNet
        from mmengine.models.qwen3_5_model import GatedAttention
    decoder.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp=tp, name="language_model.embed_tokens")
    for index, layer in enumerate(decoder.layers):
        prefix = f"language_model.layers.{index}"
        if hybrid and isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet):
            shard_gated_delta_net(layer.linear_attn, tp, f"{prefix}.linear_attn")
        elif hybrid and isinstance(layer.self_attn, GatedAttention):
            shard_gated_attention(layer.self_attn, tp, f"{prefix}.self_attn")
        elif type(layer.self_attn) is DecoderAttention:
            shard_attention(layer.self_attn, hidden, head_dim_of(config), tp, f"{prefix}.self_attn")
        else:
            raise ConfigError(f"tensor parallelism: {prefix}'s {type(layer.self_attn).__name__} is not split over ranks yet")
        shard_layer_mlp(layer.mlp, hidden, tp, f"{prefix}.mlp", expert_parallel)
    model.lm_head = ParallelLMHead(config.vocab_size, hidden, tp=tp, name="lm_head")


def load_sharded_weights(model: nn.Module, model_dir: Path, expected: dict[str, tuple[int, ...]],
                         packed: dict | None = None) -> None:
    """Every checkpoint tensor checked against the whole model's shapes (WeightCheck: missing, unexpected,
    repeated, mis-shaped ones named with their file) and this rank's part of it read (a safetensors slice).
    `packed` (the fused kernels run): the rank's slices of quantized projections kept there, not dequantized."""
    slices = CheckpointSlices(model_dir)
    check = WeightCheck(expected, slices, optional=["lm_head.weight"] if model.tie_word_embeddings else [])
    model.kv_scales = {}
    experts_seen: dict[tuple[str, int, str], str] = {}  # (layer's experts, expert, projection) -> checkpoint name
    quantization = quantization_of(model.config)
    keep = RankQuantizedLoad(model, packed) if packed is not None and quantization is not None else None
    source = slices
    if quantization is not None:
        def elsewhere(raw_name: str) -> bool:  # an expert stored apart that another rank holds: none of its parts read
            key = expert_held_elsewhere(model, expected, model.checkpoint_name(raw_name))
            if key is not None:
                experts_seen.setdefault(key, raw_name)
            return key is not None

        # this rank's part of each quantized weight read with its scales (and zeros), and dequantized
        source = quantized_weight_slices(slices, quantization, skip=elsewhere)
    for raw_name, tensor in source:
        name = model.checkpoint_name(raw_name)
        scale = KV_SCALE_NAME.match(name)
        if scale is not None:
            value = tensor[...]
            if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value) <= 0:
                raise WeightsMismatchError(f"tensor {raw_name!r}: a KV scale must be one positive number, got {tuple(value.shape)}")
            model.kv_scales[(int(scale[1]), scale[2])] = float(value)
            continue
        if name not in expected and model.is_ignorable(name):
            continue
        expert = _PER_EXPERT.match(name)
        if expert is not None and f"{expert['prefix']}.gate_up_proj" in expected:  # each expert stored apart
            key = (expert["prefix"], int(expert["expert"]), expert["proj"])
            if key in experts_seen:
                raise WeightsMismatchError(f"tensor {raw_name!r} appears twice (a parameter must be loaded once)", slices.where(raw_name))
            experts_seen[key] = raw_name
            if keep is not None and keep.expert(expert["prefix"], int(expert["expert"]), expert["proj"], tensor):
                continue  # kept quantized
            model.get_submodule(expert["prefix"]).load_expert(int(expert["expert"]), expert["proj"], tensor)
            continue
        check.accept(name, raw_name, tensor)
        parameter, piece = target_of(model, name)
        if keep is not None:
            parameter = keep.target(parameter, tensor, piece)
            if parameter is None:  # kept quantized
                continue
        load_parameter(parameter, tensor, piece, name)
    for prefix in {prefix for prefix, _, _ in experts_seen}:  # a layer's experts stored apart: every one, once
        module = model.get_submodule(prefix)
        experts = getattr(module, "num_checkpoint_experts", module.num_experts)  # (expert parallelism: the layer's, not the rank's)
        wanted = {(prefix, e, p) for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")}
        missing = sorted(wanted - set(experts_seen))
        if missing:
            raise WeightsMismatchError(f"the checkpoint lacks {len(missing)} expert tensor(s) of {prefix}, e.g. expert "
                                       f"{missing[0][1]}'s {missing[0][2]}", slices.where())
        check.loaded[f"{prefix}.gate_up_proj"] = check.loaded[f"{prefix}.down_proj"] = f"{prefix}.*"
    check.finish()
    if "lm_head.weight" not in check.loaded:
        model.lm_head.tie_to(model.language_model.embed_tokens)


def expert_held_elsewhere(model: nn.Module, expected: dict[str, tuple[int, ...]], name: str) -> tuple[str, int, str] | None:
    """(layer's experts, expert, projection) when `name` (ours) is a part of an expert stored apart that another
    rank holds (expert parallelism), else None."""
    match = _PER_EXPERT_PART.match(name)
    if match is None or f"{match['prefix']}.gate_up_proj" not in expected:
        return None
    holds = getattr(model.get_submodule(match["prefix"]), "holds", None)
    if holds is None or holds(int(match["expert"])):
        return None
    return match["prefix"], int(match["expert"]), match["proj"]


