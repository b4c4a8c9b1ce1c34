"""Gemma 3's decoder (transformers' Gemma3TextModel) over the paged KV cache.

What sets it apart from a Llama-family decoder, each as transformers 5 defines it:
- `layer_types`: five of every six layers attend within a sliding window of the last `sliding_window`
  tokens, the sixth is global; both kinds have the same head size and KV heads, each its own RoPE
  (`rope_parameters` per layer kind: theta 10k on the sliding layers, 1M with linear scaling on the
  global ones in the 4B-27B releases);
- a picture's soft tokens see each other both ways on every layer (within the window on the sliding
  ones): transformers' token_type_ids blocks, AttentionMetadata.span_ends here;
- q and k are RMS-normed per head; the softmax scale is query_pre_attn_scalar^-1/2, not the head size's;
- four norms a layer (before and after attention, before and after the MLP), all Gemma's zero-centred
  RMSNorm (`x * (1 + w)` in float32); the embeddings are scaled by sqrt(hidden) rounded to the weight
  dtype; the logits optionally soft-capped (`final_logit_softcapping`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mmengine.errors import UnsupportedModelError
from mmengine.layers.attention import Attention, AttentionMetadata
from mmengine.layers.kernel_dispatch import use_fused_kernels
from mmengine.layers.lora import LoRAContext, LoRALinear
from mmengine.layers.norm import ZeroCenteredRMSNorm
from mmengine.layers.rotary import RotaryStep, build_cos_sin_table
from mmengine.models.gemma4_text import Gemma4MLP, ScaledEmbedding
from mmengine.models.llama import DeepStack, gate_up_shard_shapes, load_with_gate_up_shards
from mmengine.models.text_config import FULL, SLIDING

SUPPORTED_TEXT_MODEL_TYPES = ("gemma3_text",)
# Frequencies that change with the sequence length: a cached K would no longer match a recomputed one
_UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


def check_text_config(config: PretrainedConfig) -> None:
    if config.model_type not in SUPPORTED_TEXT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"text model type {config.model_type!r} is not supported here; supported: {', '.join(SUPPORTED_TEXT_MODEL_TYPES)}"
        )
    kinds = list(config.layer_types)
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= {SLIDING, FULL}:
        raise UnsupportedModelError(f"layer_types {kinds} must name {SLIDING} or {FULL} for {config.num_hidden_layers} layers")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention=True (an encoder, as EmbeddingGemma) is not a decoder mmengine runs")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(f"attn_logit_softcapping={config.attn_logit_softcapping} is not supported by the attention backends")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")


def rope_inv_freq_of(config: PretrainedConfig, kind: str) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and cos/sin scaling of a layer kind, as transformers' Gemma3RotaryEmbedding
    computes them (its own default rule, else transformers' function for the kind's rope_type)."""
    params = (getattr(config, "rope_parameters", None) or {}).get(kind) or {}
    rope_type = params.get("rope_type", "default")
    head_dim = config.head_dim
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type in _UNSUPPORTED_ROPE_TYPES or rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"rope_type {rope_type!r} on Gemma 3's {kind} layers is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=kind)
    return inv_freq.float(), float(scaling)


class Gemma3Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, kind: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden, bias, eps = config.hidden_size, config.attention_bias, config.rms_norm_eps
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=config.query_pre_attn_scalar**-0.5,
                              sliding_window=config.sliding_window if kind == SLIDING else None, bidirectional_spans=True)

    def forward(self, x: torch.Tensor, rotary: RotaryStep, metadata: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, metadata, rotary))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, kind: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.kind = kind
        self.self_attn = Gemma3Attention(config, kind)
        self.mlp = Gemma4MLP(hidden, config.intermediate_size, config.hidden_activation)  # (Gemma's gated MLP)
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, rotary: RotaryStep, metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, metadata))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3DecoderModel(nn.Module):
    """Embeddings, layers, final norm; the LM head lives with the VLM."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_text_config(config)
        self.config = config
        self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, config.hidden_size**0.5)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        for kind in sorted(set(config.layer_types)):  # one cos/sin table per layer kind
            inv_freq, scaling = rope_inv_freq_of(config, kind)
            table = build_cos_sin_table(inv_freq.to(torch.get_default_device()), scaling, config.max_position_embeddings,
                                        torch.get_default_dtype())
            self.register_buffer(f"{kind}_cos_sin", table, persistent=False)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                deepstack: DeepStack | None = None) -> torch.Tensor:
        backend = self.layers[0].self_attn.attn.backend
        fused = use_fused_kernels(inputs_embeds.device, backend.name if backend is not None else None)
        rotary = {kind: RotaryStep.gather(positions, getattr(self, f"{kind}_cos_sin"), use_kernel=fused)
                  for kind in set(self.config.layer_types)}
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, rotary[layer.kind], metadata)
        return self.norm(x)

    def softcap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.softcap:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def enable_lora(self, max_loras: int, max_rank: int) -> LoRAContext:
        raise UnsupportedModelError("LoRA adapters are not supported on Gemma 3's decoder yet")

    def lora_modules(self) -> list[tuple[int, LoRALinear]]:
        return []

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Loads one checkpoint tensor named relative to this module; False if the name is unknown."""
        return load_with_gate_up_shards(self, name, tensor)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor of the decoder and its shape (gate and up separately, as saved)."""
        return gate_up_shard_shapes(self.named_parameters())
