"""What every vision-language model shares: a Llama-family decoder (`language_model`), an LM head, the
runner-facing calls (`embed_tokens`, `forward`, `compute_logits`, `encode_items`) and strict weight
loading. A family's model subclasses it with its vision side and its checkpoint key layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.errors import WeightsMismatchError
from mmengine.layers.attention import AttentionMetadata
from mmengine.layers.lora import ItemLoRAContext, LoRALinear, LoRASlice
from mmengine.layers.moe import FusedExperts
from mmengine.models.llama import STACKED_PROJECTIONS, DecoderModel, DeepStack
from mmengine.models.loader import WeightCheck, fuse_expert_tensors, materialize_parameters
from mmengine.models.quantization import PackedFp8, PackedInt4, WeightQuantization, dequantize_packed, dequantize_tensors

_ROTARY_CACHE = re.compile(r"(^|\.)rotary_emb\.")
# An FP8-KV checkpoint's per-layer scales (llm-compressor and vLLM name them so), by our name
KV_SCALE_NAME = re.compile(r"^language_model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


class VisionLanguageModel(nn.Module):
    """Subclasses build their vision modules, then call `_build_text(config)`; they implement
    `encode_items` and `checkpoint_name` (and `is_ignorable` for tensors they know and skip)."""

    language_model: DecoderModel
    lm_head: nn.Linear
    decoder_class: type[nn.Module] = DecoderModel  # a hybrid decoder's family sets its own

    def _build_text(self, config: PretrainedConfig) -> None:
        text = config.text_config
        self.language_model = self.decoder_class(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False)) or bool(
            getattr(config, "tie_word_embeddings", False)
        )

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # -- encoder -----------------------------------------------------------------

    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One step's items (their encoder inputs, as the family split them) through the vision side,
        batched as the tower likes; one [num_tokens, text_hidden] tensor per item, in order."""
        raise NotImplementedError

    def encoder_rows(self, item: dict[str, torch.Tensor]) -> int:
        """An item's share of the vision side's rows in encode_items (how a batch's rows split among
        its items): 1 for a tower that takes a [batch, patches, dim] batch; families that pack
        patches override it."""
        return 1

    def vision_linears(self) -> dict[str, nn.Linear]:
        """Every linear layer of the vision side (tower and projector), by its name in this model:
        what a LoRA adapter on the vision side may target."""
        return {
            name: module for name, module in self.named_modules()
            if isinstance(module, nn.Linear) and not name.startswith(("language_model.", "lm_head"))
        }

    def enable_vision_lora(self, max_loras: int, max_rank: int) -> tuple[ItemLoRAContext, dict[str, LoRALinear]]:
        """Gives every vision-side linear layer `max_loras` adapter slots; returns their shared context
        and the layers by name."""
        context = ItemLoRAContext()
        wrapped = {}
        for name, linear in self.vision_linears().items():
            parent_name, _, attr = name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            wrapped[name] = LoRALinear(linear, [LoRASlice(name, 0, linear.out_features)], context, max_loras, max_rank)
            setattr(parent, attr, wrapped[name])
        return context, wrapped

    # -- decoder -------------------------------------------------------------------

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, deepstack: DeepStack | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_ids`: the step's token ids, for a decoder that reads them beside the embeddings (Gemma 4's
        per-layer inputs)."""
        return self.language_model(inputs_embeds, positions, metadata, deepstack)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    # -- weights -------------------------------------------------------------------

    def checkpoint_name(self, raw_name: str) -> str:
        """Our name for a checkpoint tensor's name (each family maps its key layouts onto ours)."""
        raise NotImplementedError

    def is_ignorable(self, name: str) -> bool:
        """Whether a checkpoint tensor the model has no parameter for is known and safely skipped."""
        return name.startswith("language_model.") and bool(_ROTARY_CACHE.search(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: WeightQuantization | None = None,
                     packed: dict[str, PackedInt4 | PackedFp8] | None = None) -> None:
        """Loads every parameter exactly once. A missing, unexpected, repeated or mis-shaped tensor raises
        WeightsMismatchError naming it, the shapes and the file; a missing lm_head.weight is fine only
        when the checkpoint ties word embeddings."""
        expected = self.expected_weights()
        check = WeightCheck(expected, weights, optional=["lm_head.weight"] if self.tie_word_embeddings else [])
        deferred = {name for name, param in self.named_parameters() if param.is_meta}  # see defer_quantizable_weights
        self._parameter_names = {name for name, _ in self.named_parameters()}

        def keep_packed(owner: str) -> bool:
            return self._target_parameter(self.checkpoint_name(f"{owner}.weight")) in deferred

        self._skipped_dense: set[str] = set()  # our names of the weights loaded as kernel layouts only
        tensors = dequantize_tensors(weights, quantization, packed, keep_packed) if quantization is not None else weights
        num_experts = getattr(self.language_model.config, "num_experts", 0) or 0
        self.kv_scales: dict[tuple[int, str], float] = {}
        for raw_name, tensor in fuse_expert_tensors(tensors, num_experts) if num_experts > 0 else tensors:
            name = self.checkpoint_name(raw_name)
            kv_scale = KV_SCALE_NAME.match(name)
            if kv_scale is not None:  # used by an FP8 KV cache only (apply_kv_scales)
                self._keep_kv_scale(int(kv_scale[1]), kv_scale[2], raw_name, tensor)
                continue
            if name not in expected and self.is_ignorable(name):
                continue
            check.accept(name, raw_name, tensor)
            if tensor.is_meta:
                self._skipped_dense.add(name)
                continue
            with torch.no_grad():
                self._materialize(self._target_parameter(name))
                self._load_one(name, tensor)
        check.finish()
        if "lm_head.weight" not in check.loaded:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: list[str]) -> None:
        """New values for some of the loaded parameters (checkpoint names, as `load_weights` takes them),
        copied in place, so CUDA graphs read them. Each is checked as at load: a name the model has no
        parameter for, one given twice, a wrong shape, a KV scale (read at start-up only) or a weight kept as
        a quantized kernel layout raises WeightsMismatchError naming it; those before it stay loaded.
        Appends to `loaded` our name of each tensor as it is loaded."""
        expected = self.expected_weights()
        check = WeightCheck(expected, weights, optional=["lm_head.weight"] if self.tie_word_embeddings else [])

        def kept_quantized(name: str) -> bool:
            return name in self._skipped_dense or self._target_parameter(name) in self._skipped_dense

        for name, tensor in checked_updates(self, weights, expected, check, kept_quantized):
            with torch.no_grad():
                self._load_one(name, tensor)
            loaded.append(name)

    def _keep_kv_scale(self, layer: int, which: str, raw_name: str, tensor: torch.Tensor) -> None:
        attention = getattr(self.language_model.layers[layer], "self_attn", None) if layer < len(self.language_model.layers) else None
        if attention is None or tensor.numel() != 1 or not bool(torch.isfinite(tensor).all()) or float(tensor) <= 0:
            raise WeightsMismatchError(f"tensor {raw_name!r}: a KV scale must be one positive number of an attention layer, "
                                       f"got {tuple(tensor.shape)}")
        self.kv_scales[(layer, which)] = float(tensor)

    def apply_kv_scales(self) -> int:
        """Gives each attention layer the checkpoint's K and V scales for an FP8 cache (1.0 where it has
        none); returns how many layers had theirs."""
        found = 0
        for index, layer in enumerate(self.language_model.layers):
            attention = getattr(getattr(layer, "self_attn", None), "attn", None)
            if attention is None:
                continue
            attention.k_scale = self.kv_scales.get((index, "k"), 1.0)
            attention.v_scale = self.kv_scales.get((index, "v"), 1.0)
            found += (index, "k") in self.kv_scales or (index, "v") in self.kv_scales
        return found

    def defer_quantizable_weights(self, device: torch.device) -> None:
        """For a model built with its parameters on meta (loader.parameters_on_meta): storage for every
        parameter but the weights a quantized layer may replace (the decoder's fused projections, SiLU
        experts); those stay on meta, so a quantized checkpoint never holds its dense weights on the device."""
        quantizable = set()
        for index, layer in enumerate(self.language_model.layers):
            quantizable |= {f"language_model.layers.{index}.{path}.weight" for path in quantizable_projections(layer)}
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if isinstance(experts, FusedExperts) and experts.act.fusable:
                quantizable |= {f"language_model.layers.{index}.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")}
        materialize_parameters(self, device, keep_meta=quantizable.__contains__)

    def _materialize(self, name: str) -> None:
        """Storage for the meta parameter `name` (a deferred weight whose checkpoint tensor came dense)."""
        module_name, _, attr = name.rpartition(".")
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return
        param = module._parameters.get(attr)
        if param is not None and param.is_meta:
            device = self.language_model.embed_tokens.weight.device  # never deferred
            module._parameters[attr] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)

    def use_quantized_weights(self, packed: dict[str, PackedInt4 | PackedFp8]) -> int:
        """Swaps the decoder's dense projections for quantized layers wherever the checkpoint's int4 or
        FP8 weights (by checkpoint name, as dequantize_tensors kept them) cover all their shards; returns
        how many. A weight loaded as a kernel layout only whose layer cannot take it after all (its shards
        disagree) is dequantized into its dense parameter; then no parameter may be left on meta."""
        ours = {self.checkpoint_name(f"{name}.weight").removesuffix(".weight"): p for name, p in packed.items()}
        decoder_packed = {n.removeprefix("language_model."): p for n, p in ours.items()}
        swapped = use_quantized_projections(self.language_model, decoder_packed) + use_quantized_experts(self.language_model, decoder_packed)
        with torch.no_grad():
            for name, layout in decoder_packed.items():  # those the swaps did not take
                ours_name = f"language_model.{name}.weight"
                # a shard's name, or (experts are stacked before they load) the stack's
                if ours_name in self._skipped_dense or self._target_parameter(ours_name) in self._skipped_dense:
                    self._materialize(self._target_parameter(ours_name))
                    self._load_dense_expert_or_shard(ours_name, dequantize_packed(layout))
        left = [name for name, param in self.named_parameters() if param.is_meta]
        if left:
            raise RuntimeError(f"parameters left without storage after loading: {', '.join(left[:8])}")
        return swapped

    def _load_dense_expert_or_shard(self, name: str, dense: torch.Tensor) -> None:
        expert = _PER_EXPERT_WEIGHT.match(name)
        if expert is None:
            self._load_one(name, dense.to(self.lm_head.weight.dtype))
            return
        fused = self.get_parameter(self._target_parameter(name))
        index, proj = int(expert["expert"]), expert["proj"]
        rows = fused.shape[1] // 2 if proj != "down_proj" else fused.shape[1]
        offset = rows if proj == "up_proj" else 0
        fused.data[index, offset:offset + rows].copy_(dense)

    def _target_parameter(self, name: str) -> str:
        """The parameter a checkpoint weight (our name) loads into: its fused parameter where the model has
        it (Qwen3.5's gated attention keeps q, k and v apart)."""
        fused = _fused_parameter(name)
        return fused if fused in self._parameter_names else name

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """Our name of every checkpoint tensor the model needs, with its shape."""
        expected = {n: tuple(p.shape) for n, p in self.named_parameters() if not n.startswith("language_model.")}
        expected.update({f"language_model.{n}": shape for n, shape in self.language_model.checkpoint_shapes().items()})
        return expected

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith("language_model."):
            if not self.language_model.load_weight(name.removeprefix("language_model."), tensor):
                raise WeightsMismatchError(f"the decoder did not take tensor {name!r}")
        else:
            self.get_parameter(name).copy_(tensor)


def quantizable_projections(layer: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each linear layer of a decoder layer a quantized layer may replace (its path: attention, MLP, Gated
    DeltaNet and shared-expert projections alike), with the checkpoint shards that fill it (a fused
    q/k/v or gate/up has several)."""
    found = {}
    for path, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            prefix, _, attr = path.rpartition(".")
            shards = tuple(f"{prefix}.{shard}" if prefix else shard for shard, (fused, _) in STACKED_PROJECTIONS.items() if fused == attr)
            found[path] = shards or (path,)
    return found


_PER_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _fused_parameter(name: str) -> str:
    """The fused parameter a checkpoint weight (our name) loads into where the model fuses it: a shard's
    fused projection, an expert's stacked weights, else itself."""
    expert = _PER_EXPERT_WEIGHT.match(name)
    if expert is not None:
        return f"{expert['prefix']}.{'down_proj' if expert['proj'] == 'down_proj' else 'gate_up_proj'}"
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in STACKED_PROJECTIONS:
        parts[-2] = STACKED_PROJECTIONS[parts[-2]][0]
    return ".".join(parts)


def use_quantized_projections(decoder: DecoderModel, packed: dict[str, PackedInt4 | PackedFp8]) -> int:
    """A quantized layer for each of the decoder's linear layers whose shards all have quantized weights of
    one layout (`packed` by our decoder-relative names, e.g. "layers.0.self_attn.q_proj"); the shards it
    takes leave `packed`."""
    from mmengine.layers.quantized_linear import fuse_shards

    swapped = 0
    for index, layer in enumerate(decoder.layers):
        for path, shards in quantizable_projections(layer).items():
            parts = [packed.get(f"layers.{index}.{shard}") for shard in shards]
            if any(p is None for p in parts):
                continue
            parent_name, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            dense = getattr(parent, attr)
            # (the dense weight may be on meta: see VisionLanguageModel.defer_quantizable_weights)
            embed = decoder.embed_tokens.weight  # never deferred: the device and the model's dtype
            replacement = fuse_shards(parts, None if dense.bias is None else dense.bias.data, embed.device, embed.dtype)
            if replacement is None:
                continue
            if (replacement.in_features, replacement.out_features) != (dense.in_features, dense.out_features):
                raise WeightsMismatchError(f"quantized shards of layers.{index}.{path} make a {replacement.in_features} x "
                                           f"{replacement.out_features} projection, expected {dense.in_features} x {dense.out_features}")
            setattr(parent, attr, replacement)
            for shard in shards:
                del packed[f"layers.{index}.{shard}"]
            swapped += 1
    return swapped


def use_quantized_experts(decoder: DecoderModel, packed: dict[str, PackedInt4 | PackedFp8]) -> int:
    """Quantized experts for each MoE layer whose every expert has gate, up and down weights of one format
    and group size (`packed` by decoder-relative names, "layers.0.mlp.experts.3.gate_proj"): FP8 ones, or
    int4 ones without act-order (each expert would have its own input order); returns how many layers."""
    from mmengine.layers.moe import Fp8FusedExperts, Int4FusedExperts, SparseMoeBlock

    swapped = 0
    for index, layer in enumerate(decoder.layers):
        block = getattr(layer, "mlp", None)
        if not isinstance(block, SparseMoeBlock) or not block.experts.act.fusable:
            continue
        dense = block.experts
        parts = {(proj, e): packed.get(f"layers.{index}.mlp.experts.{e}.{proj}") for e in range(dense.num_experts)
                 for proj in ("gate_proj", "up_proj", "down_proj")}
        device = decoder.embed_tokens.weight.device  # the experts' own weights may be on meta

        def stacked(field: str, projs: tuple[str, ...], dim: int) -> torch.Tensor:
            """Per expert, the projections' `field` side by side along the outputs (`dim`), stacked over experts."""
            return torch.stack([torch.cat([getattr(parts[proj, e], field) for proj in projs], dim=dim)
                                for e in range(dense.num_experts)]).to(device)

        gate_up, down = ("gate_proj", "up_proj"), ("down_proj",)
        if all(isinstance(p, PackedFp8) for p in parts.values()) and len({p.group_k for p in parts.values()}) == 1:
            block.experts = Fp8FusedExperts(dense, stacked("weight", gate_up, 0), stacked("scales", gate_up, 0),
                                            stacked("weight", down, 0), stacked("scales", down, 0), parts["gate_proj", 0].group_k)
        elif (all(isinstance(p, PackedInt4) and p.g_idx is None for p in parts.values())
              and len({p.group_size for p in parts.values()}) == 1):
            block.experts = Int4FusedExperts(dense, stacked("qweight", gate_up, 1), stacked("scales", gate_up, 1),
                                             stacked("zeros", gate_up, 1), stacked("qweight", down, 1), stacked("scales", down, 1),
                                             stacked("zeros", down, 1), parts["gate_proj", 0].group_size)
        else:
            continue
        for proj, e in parts:
            del packed[f"layers.{index}.mlp.experts.{e}.{proj}"]
        swapped += 1
    return swapped


def checked_updates(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]],
                    check: WeightCheck, kept_quantized: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """update_weights' tensors as (our name, tensor), checked as at load (`check`: a name the model has no parameter
    for, one given twice, a wrong shape) and refused by name where an update cannot go: a KV scale (read at start-up
    only), a weight whose layer runs quantized (`kept_quantized`). Experts stored one by one come stacked. Shared by
    a single-process model and a tensor-parallel rank's (distributed/sharded_update.py)."""
    num_experts = getattr(model.language_model.config, "num_experts", 0) or 0
    for raw_name, tensor in fuse_expert_tensors(weights, num_experts) if num_experts > 0 else weights:
        name = model.checkpoint_name(raw_name)
        if KV_SCALE_NAME.match(name):
            raise WeightsMismatchError(f"tensor {raw_name!r}: KV-cache scales are read at start-up only")
        if name not in expected and model.is_ignorable(name):
            continue
        check.accept(name, raw_name, tensor)
        if kept_quantized(name):
            raise WeightsMismatchError(f"tensor {raw_name!r}: its layer runs on quantized weights, which update_weights "
                                       "does not replace")
        yield name, tensor
