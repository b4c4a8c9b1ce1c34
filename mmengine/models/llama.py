"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Qwen3-VL's text model) over a paged KV cache.

Q/K/V and gate/up are fused into one matmul each; `load_weight` splits checkpoint
tensors into them. The module layout otherwise follows transformers' names so that
checkpoint keys map one to one.
"""

from __future__ import annotations

from collections.abc import Iterable

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.layers.activation import GatedActivation
from mmengine.layers.attention import Attention, AttentionMetadata
from mmengine.layers.kernel_dispatch import use_fused_kernels
from mmengine.layers.lora import LoRAContext, LoRALinear, LoRASlice
from mmengine.layers.moe import SparseMoeBlock, is_sparse_layer
from mmengine.layers.norm import RMSNorm, add_norm
from mmengine.layers.rotary import RotaryEmbedding, RotaryStep
from mmengine.models.text_config import QWEN2_TEXT_MODEL_TYPES, head_dim_of

SUPPORTED_TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3", "qwen3_vl_text",
                              "qwen3_vl_moe_text")
# Qwen3-style attention: an RMSNorm over each head of q and of k, before the rotary embedding.
_QK_NORM_TEXT_MODEL_TYPES = ("qwen3", "qwen3_vl_text", "qwen3_vl_moe_text")

# checkpoint projection name -> (fused parameter name, shard)
STACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass
class DeepStack:
    """Qwen3-VL's DeepStack: vision features added to the output of the first decoder layers at the
    picture's token rows (level i after layer i)."""

    rows: torch.Tensor  # [n] rows of the step's packed tokens that are picture placeholders
    levels: torch.Tensor  # [num_levels, n, hidden]


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        attention_bias = bool(getattr(config, "attention_bias", False))
        qwen2 = config.model_type in QWEN2_TEXT_MODEL_TYPES
        qkv_bias = qwen2 or attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=attention_bias and not qwen2)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)
        self.q_norm = self.k_norm = None
        if config.model_type in _QK_NORM_TEXT_MODEL_TYPES:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: RotaryStep, metadata: AttentionMetadata, fused: bool = False) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim), use_kernel=fused)
            k = self.k_norm(k.reshape(-1, self.head_dim), use_kernel=fused)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, metadata, rotary))

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        target = getattr(self.qkv_proj, param)
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size), "v": (self.q_size + self.kv_size, self.kv_size)}[shard]
        copy_checked(target.data[offset : offset + size], tensor, f"qkv_proj.{param}[{shard}]")


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: the config's unless given (a MoE block's shared expert has its own)."""
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=bias)
        self.act = GatedActivation(config.hidden_act)

    def forward(self, x: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x), use_kernels))

    def load_shard(self, shard: int, param: str, tensor: torch.Tensor) -> None:
        target = getattr(self.gate_up_proj, param).data
        n = self.intermediate_size
        copy_checked(target[shard * n : (shard + 1) * n], tensor, f"gate_up_proj.{param}[{shard}]")


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config)
        self.mlp = SparseMoeBlock(config) if is_sparse_layer(config, index) else DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryStep,
        metadata: AttentionMetadata,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with residual None); residual: the stream
        before it. Returns (this layer's output, the stream before it); their sum is the new stream.
        Each residual add happens inside the next RMSNorm (one fused kernel when `fused`)."""
        h, residual = add_norm(self.input_layernorm, x, residual, fused)
        h = self.self_attn(h, rotary, metadata, fused)
        h, residual = self.post_attention_layernorm(h, residual, use_kernel=fused)
        return self.mlp(h, fused), residual


class DecoderModel(nn.Module):
    """Embeddings, layers and final norm; the LM head lives with the VLM that owns this decoder."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_text_config(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # One cos/sin table for every layer, up to max_position_embeddings (the engine's bound on max_model_len).
        self.rotary = RotaryEmbedding(config, head_dim_of(config))

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
        deepstack: DeepStack | None = None,
    ) -> torch.Tensor:
        backend = self.layers[0].self_attn.attn.backend
        fused = use_fused_kernels(inputs_embeds.device, backend.name if backend is not None else None)
        rotary = self.rotary.step(positions, fused)  # the reference path gathers cos/sin here, once per step
        x, residual = inputs_embeds, None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rotary, metadata, fused)
            if deepstack is not None and index < deepstack.levels.shape[0]:
                # the stream is x + residual: adding to x adds to the layer's output, as transformers does
                x = x.index_add(0, deepstack.rows, deepstack.levels[index].to(x.dtype))
        return add_norm(self.norm, x, residual, fused)[0]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def enable_lora(self, max_loras: int, max_rank: int) -> LoRAContext:
        """Gives every projection `max_loras` adapter slots (LoRALinear, sharing the loaded weights);
        returns the context through which the runner sets each step's adapter rows."""
        if any(isinstance(layer.mlp, SparseMoeBlock) for layer in self.layers):
            raise UnsupportedModelError("LoRA adapters are not supported on mixture-of-experts decoders yet")
        context = LoRAContext()
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
            attn.qkv_proj = LoRALinear(attn.qkv_proj, [LoRASlice("q_proj", 0, q), LoRASlice("k_proj", q, kv),
                                                       LoRASlice("v_proj", q + kv, kv)], context, max_loras, max_rank)
            attn.o_proj = LoRALinear(attn.o_proj, [LoRASlice("o_proj", 0, attn.o_proj.out_features)], context, max_loras, max_rank)
            mlp.gate_up_proj = LoRALinear(mlp.gate_up_proj, [LoRASlice("gate_proj", 0, inter), LoRASlice("up_proj", inter, inter)],
                                          context, max_loras, max_rank)
            mlp.down_proj = LoRALinear(mlp.down_proj, [LoRASlice("down_proj", 0, mlp.down_proj.out_features)], context, max_loras, max_rank)
        return context

    def lora_modules(self) -> list[tuple[int, LoRALinear]]:
        """(layer index, projection) for every LoRALinear, after enable_lora."""
        return [
            (index, module)
            for index, layer in enumerate(self.layers)
            for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if isinstance(module, LoRALinear)
        ]

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor of the decoder and its shape (q/k/v and gate/up separately, as saved)."""
        return decoder_checkpoint_shapes(self)

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Loads one checkpoint tensor named relative to this module; False if the name is unknown."""
        parts = name.split(".")
        if "rotary_emb" in parts:  # old checkpoints saved inv_freq buffers; we recompute them
            return True
        if len(parts) >= 5 and parts[0] == "layers" and parts[-2] in STACKED_PROJECTIONS:  # (a shared expert's too)
            fused, shard = STACKED_PROJECTIONS[parts[-2]]
            owner = self.get_submodule(".".join(parts[:-2]))
            owner.load_shard(shard, parts[-1], tensor)
            return True
        try:
            param = self.get_parameter(name)
        except AttributeError:
            return False
        copy_checked(param.data, tensor, name)
        return True


def check_text_config(config: PretrainedConfig) -> None:
    if config.model_type not in SUPPORTED_TEXT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"text model type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_TEXT_MODEL_TYPES)}"
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise UnsupportedModelError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def decoder_checkpoint_shapes(decoder: DecoderModel) -> dict[str, tuple[int, ...]]:
    """The decoder's checkpoint tensors (q/k/v and gate/up separately, as checkpoints store them) and
    their shapes, from its parameters: a fused parameter is split into its shards along dim 0."""
    config = decoder.config
    head_dim = head_dim_of(config)
    rows = {
        "q": config.num_attention_heads * head_dim,
        "k": config.num_key_value_heads * head_dim,
        "v": config.num_key_value_heads * head_dim,
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in decoder.named_parameters():
        owner, fused, leaf = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)
        shards = [(proj, shard) for proj, (target, shard) in STACKED_PROJECTIONS.items() if target == fused]
        if not shards:
            shapes[name] = tuple(param.shape)
            continue
        rows[0] = rows[1] = param.shape[0] // 2  # gate and up: this MLP's intermediate size (a shared expert has its own)
        assert sum(rows[shard] for _, shard in shards) == param.shape[0], (name, param.shape)
        for proj, shard in shards:
            shapes[f"{owner}.{proj}.{leaf}"] = (rows[shard], *param.shape[1:])
    return shapes


def load_with_gate_up_shards(decoder: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """One checkpoint tensor (named relative to `decoder`) into a decoder that fuses only gate and up:
    a gate or up shard into its MLP's gate_up_proj, else the parameter or buffer (e.g. a layer scalar) of
    that name. False if the name is unknown."""
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "layers" and parts[-2] in ("gate_proj", "up_proj"):  # (a shared expert's too)
        decoder.get_submodule(".".join(parts[:-2])).load_shard(("gate_proj", "up_proj").index(parts[-2]), parts[-1], tensor)
        return True
    for get in (decoder.get_parameter, decoder.get_buffer):
        try:
            target = get(name)
        except AttributeError:
            continue
        copy_checked(target.data, tensor, name)
        return True
    return False


def gate_up_shard_shapes(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensors and their shapes from a decoder's parameters: a fused gate_up_proj weight as its
    gate and up halves (the experts' 3-D gate_up_proj is saved fused), everything else as it is."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in named:
        if name.endswith("gate_up_proj.weight"):
            owner = name.removesuffix("gate_up_proj.weight")
            shapes[owner + "gate_proj.weight"] = shapes[owner + "up_proj.weight"] = (param.shape[0] // 2, *param.shape[1:])
        else:
            shapes[name] = tuple(param.shape)
    return shapes
