"""Llama 4's decoder (transformers' Llama4TextModel) over the paged KV cache.

What sets it apart from a Llama-family decoder, each as transformers 5 defines it:
- `no_rope_layers`: most layers rotate q and k (RoPE on interleaved pairs, complex-number style) and attend
  within chunks of `attention_chunk_size` tokens (a query at p sees keys from floor(p / C) * C to p: `layer_types`
  "chunked_attention"); the others (every fourth in the releases) are NoPE layers with full causal attention,
  whose queries are scaled by the attention temperature log1p(floor((p + 1) / floor_scale)) * attn_scale + 1
  when `attn_temperature_tuning`;
- on RoPE layers with `use_qk_norm`, q and k are L2-normed per head (an RMS norm without weight) after rotating;
- the MLP of the layers in `moe_layers` is a mixture of experts: a top-k router whose chosen logits go through a
  sigmoid and scale the token *before* it enters its expert (not the expert's output), plus a shared expert on
  every token; the other layers have a dense MLP of `intermediate_size_mlp`.

The pairs are rotated interleaved ((x0, x1), (x2, x3), ...); the engine's rotary is GPT-NeoX's (halves). Permuting
each head's q and k rows at load (even dimensions first, then odd) turns one into the other: q.k is unchanged by a
permutation applied to both, as is the L2 norm. The cos and sin are computed from each step's positions, in float32
as transformers does, and the rotation too (no table of every position: the releases allow 10M). The experts are saved as transformers keeps them,
`gate_up_proj` [experts, hidden, 2 x inter] and `down_proj` [experts, inter, hidden]: transposed at load into
layers/moe.py's FusedExperts layout, so the fused MoE kernel runs them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.kv_cache.chunked_attention import AttentionChunk
from mmengine.layers.attention import Attention, AttentionMetadata
from mmengine.layers.kernel_dispatch import use_fused_kernels
from mmengine.layers.lora import LoRAContext, LoRALinear
from mmengine.layers.moe import FusedExperts
from mmengine.layers.norm import RMSNorm, add_norm
from mmengine.layers.rotary import rope_inv_freq, rotate_half
from mmengine.models.llama import DecoderMLP, DeepStack, copy_checked, gate_up_shard_shapes, load_with_gate_up_shards

CHUNKED, FULL = "chunked_attention", "full_attention"
SUPPORTED_TEXT_MODEL_TYPES = ("llama4_text",)


def check_text_config(config: PretrainedConfig) -> None:
    if config.model_type not in SUPPORTED_TEXT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"text model type {config.model_type!r} is not supported here; supported: {', '.join(SUPPORTED_TEXT_MODEL_TYPES)}"
        )
    kinds = list(config.layer_types)
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= {CHUNKED, FULL}:
        raise UnsupportedModelError(f"layer_types {kinds} must name {CHUNKED} or {FULL} for {config.num_hidden_layers} layers")
    if CHUNKED in kinds and not config.attention_chunk_size:
        raise UnsupportedModelError("chunked_attention layers need an attention_chunk_size")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")


def layer_chunk(config: PretrainedConfig, index: int) -> AttentionChunk | None:
    """The attention chunk of decoder layer `index` (None: it attends to every earlier token)."""
    return AttentionChunk(config.attention_chunk_size) if config.layer_types[index] == CHUNKED else None


def interleaved_to_halves(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q or k projection (heads x head_dim, ...) with each head's even dimensions first, then its odd ones."""
    heads = weight.shape[0] // head_dim
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return weight.view(heads, head_dim, *weight.shape[1:])[:, order].reshape(weight.shape)


class Llama4Rotary(nn.Module):
    """transformers' Llama4TextRotaryEmbedding: cos and sin of each position times the inverse frequencies, in float32."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, config.head_dim)
        self.register_buffer("inv_freq", inv_freq.float().to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [tokens, 1, head_dim] float32, each frequency twice (the halves' layout)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos() * self.scaling, angles.sin() * self.scaling


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated in float32 (transformers' complex product), back in x's dtype."""
    h = x.float()
    return (h * cos + rotate_half(h) * sin).type_as(x)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama4TextL2Norm: an RMS norm without weight, in float32."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.use_rope = bool(config.no_rope_layers[index])
        self.qk_norm = bool(config.use_qk_norm) and self.use_rope
        self.eps = config.rms_norm_eps
        self.temperature_tuning = bool(config.attn_temperature_tuning) and not self.use_rope
        self.floor_scale, self.attn_scale = config.floor_scale, config.attn_scale
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5,
                              attention_chunk=layer_chunk(config, index))

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        if self.qk_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature_tuning:
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, metadata))

    def load_projection(self, name: str, tensor: torch.Tensor) -> None:
        """q and k rows into the rotary's layout (on RoPE layers); v and o as saved."""
        proj, param = name.split(".")
        if self.use_rope and proj in ("q_proj", "k_proj"):
            tensor = interleaved_to_halves(tensor, self.head_dim)
        copy_checked(getattr(getattr(self, proj), param).data, tensor, name)


class Llama4Moe(nn.Module):
    """transformers' Llama4TextMoe: sigmoid of the chosen router logits times the token into each chosen expert,
    summed, plus the shared expert."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = FusedExperts(config.num_local_experts, config.hidden_size, config.intermediate_size, config.hidden_act,
                                    self.top_k)
        self.shared_expert = DecoderMLP(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        logits = self.router(x)
        top, experts = torch.topk(logits, self.top_k, dim=1)
        scores = torch.sigmoid(top.float()).to(x.dtype)  # [T, k]
        routed_in = (x[:, None, :] * scores[:, :, None]).flatten(0, 1)  # each chosen expert's own scaled copy
        ones = torch.ones(routed_in.shape[0], 1, dtype=x.dtype, device=x.device)
        routed = self.experts(routed_in, ones, experts.reshape(-1, 1), use_kernels).view(x.shape[0], self.top_k, -1)
        return self.shared_expert(x, use_kernels) + routed.sum(dim=1)

    def load_experts(self, name: str, tensor: torch.Tensor) -> None:
        """`gate_up_proj` [experts, hidden, 2 x inter] / `down_proj` [experts, inter, hidden] as transformers saves them."""
        copy_checked(getattr(self.experts, name).data, tensor.transpose(1, 2), f"experts.{name}")


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Llama4Attention(config, index)
        self.is_moe = index in config.moe_layers
        self.feed_forward = Llama4Moe(config) if self.is_moe else DecoderMLP(config, config.intermediate_size_mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: tuple[torch.Tensor, torch.Tensor],
                positions: torch.Tensor, metadata: AttentionMetadata, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.DecoderLayer: (this layer's output, the stream before it), each residual add inside the next norm."""
        h, residual = add_norm(self.input_layernorm, x, residual, fused)
        h = self.self_attn(h, rotary, positions, metadata)
        h, residual = self.post_attention_layernorm(h, residual, use_kernel=fused)
        return self.feed_forward(h, fused), residual


class Llama4DecoderModel(nn.Module):
    """Embeddings, layers, final norm; the LM head lives with the VLM."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_text_config(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Llama4DecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Llama4Rotary(config)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                deepstack: DeepStack | None = None) -> torch.Tensor:
        backend = self.layers[0].self_attn.attn.backend
        fused = use_fused_kernels(inputs_embeds.device, backend.name if backend is not None else None)
        # q and k are normed after rotating: the rotation is PyTorch's here, the store the backend's
        rotary = self.rotary(positions)
        x, residual = inputs_embeds, None
        for layer in self.layers:
            x, residual = layer(x, residual, rotary, positions, metadata, fused)
        return add_norm(self.norm, x, residual, fused)[0]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def enable_lora(self, max_loras: int, max_rank: int) -> LoRAContext:
        raise UnsupportedModelError("LoRA adapters are not supported on Llama 4's decoder (a mixture of experts) yet")

    def lora_modules(self) -> list[tuple[int, LoRALinear]]:
        return []

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Loads one checkpoint tensor named relative to this module; False if the name is unknown."""
        parts = name.split(".")
        if "rotary_emb" in parts:
            return True
        if len(parts) == 5 and parts[0] == "layers" and parts[2] == "self_attn" and parts[3].endswith("_proj"):
            self.layers[int(parts[1])].self_attn.load_projection(".".join(parts[3:]), tensor)
            return True
        if len(parts) == 5 and parts[0] == "layers" and parts[3] == "experts":
            self.layers[int(parts[1])].feed_forward.load_experts(parts[4], tensor)
            return True
        return load_with_gate_up_shards(self, name, tensor)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor of the decoder and its shape (gate and up apart, the experts as transformers saves them)."""
        shapes = gate_up_shard_shapes(self.named_parameters())
        for name in list(shapes):
            if ".experts." in name:
                experts, inner, outer = shapes[name]
                shapes[name] = (experts, outer, inner)
        return shapes
