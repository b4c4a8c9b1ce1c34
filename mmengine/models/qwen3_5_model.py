"""Qwen3.5's model (Qwen3_5Family's model_class): the hybrid decoder (Gated DeltaNet and gated attention layers) under
Qwen3-VL's vision tower, and its multi-token-prediction head; the family is in qwen3_5.py.

Three of every four decoder layers (`layer_types` "linear_attention") are Gated DeltaNet: no KV cache,
a recurrent state per request instead (layers/gated_delta.py). The others are gated full attention
over the paged KV cache: q_proj gives each head its query and an output gate, q and k are
RMS-normed per head, only the first quarter of each head is rotated (interleaved M-RoPE), and the
attention output is multiplied by sigmoid(gate). Every RMSNorm of the decoder is zero-centred.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError, WeightsMismatchError
from mmengine.layers.attention import Attention, AttentionMetadata
from mmengine.layers.gated_delta import GatedDeltaNet, GatedDeltaShape
from mmengine.layers.kernel_dispatch import use_fused_kernels
from mmengine.layers.lora import LoRAContext, LoRALinear
from mmengine.layers.moe import SparseMoeBlock
from mmengine.layers.norm import ZeroCenteredRMSNorm, add_norm
from mmengine.layers.rotary import RotaryEmbedding, RotaryStep
from mmengine.models.llama import (DecoderMLP, DeepStack, gate_up_shard_shapes, head_dim_of,
                                   load_with_gate_up_shards)
from mmengine.models.qwen3_5_mtp import MultiTokenPredictor
from mmengine.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION
from mmengine.models.qwen_vl_model import QwenVLModel

SUPPORTED_TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def rotary_dim_of(config: PretrainedConfig) -> int:
    """How many leading dims of each head rotate (partial_rotary_factor of head_dim)."""
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    return int(head_dim_of(config) * factor)


class GatedAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.rotary_dim = rotary_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, 2 * self.num_heads * self.head_dim, bias=bias)  # query | gate, per head
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, rotary: RotaryStep, metadata: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        query, gate = self.q_proj(x).view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(query)
        k = self.k_norm(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        r = self.rotary_dim
        q_rot, k_rot = rotary.apply(q[..., :r], k[..., :r])
        q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        out = self.attn(q, k, v, metadata)  # already rotated: the cache stores k as is
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(GatedDeltaShape.of(config))
        else:
            self.self_attn = GatedAttention(config)
        if getattr(config, "num_experts", 0) > 0:  # Qwen3.5-MoE: routed experts and a gated shared expert in every layer
            self.mlp = SparseMoeBlock(config, DecoderMLP(config, config.shared_expert_intermediate_size))
        else:
            self.mlp = DecoderMLP(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryStep, metadata: AttentionMetadata, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As models/llama.DecoderLayer: returns (this layer's output, the stream before it)."""
        h, residual = add_norm(self.input_layernorm, x, residual)
        if self.layer_type == LINEAR_ATTENTION:
            assert metadata.recurrent is not None, "a hybrid model's step needs its RecurrentStep"
            h = self.linear_attn(h, metadata.recurrent)
        else:
            h = self.self_attn(h, rotary, metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, fused), residual


class HybridDecoderModel(nn.Module):
    """The decoder's embeddings, layers and final norm, with the calls the runner and VisionLanguageModel make."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_hybrid_text_config(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, rotary_dim_of(config))

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, deepstack: DeepStack | None = None
    ) -> torch.Tensor:
        backend = self.attention_layers()[0].backend
        fused = use_fused_kernels(inputs_embeds.device, backend.name if backend is not None else None)
        rotary = self.rotary.step(positions, use_kernel=False)  # partial rotation: the PyTorch path rotates
        x, residual = inputs_embeds, None
        for layer in self.layers:
            x, residual = layer(x, residual, rotary, metadata, fused)
        return add_norm(self.norm, x, residual)[0]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers if layer.layer_type == FULL_ATTENTION]

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.layers if layer.layer_type == LINEAR_ATTENTION]

    def enable_lora(self, max_loras: int, max_rank: int) -> LoRAContext:
        raise UnsupportedModelError("LoRA adapters are not supported on Qwen3.5's hybrid decoder yet")

    def lora_modules(self) -> list[tuple[int, LoRALinear]]:
        return []

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Loads one checkpoint tensor named relative to this module; False if the name is unknown."""
        return "rotary_emb" in name.split(".") or load_with_gate_up_shards(self, name, tensor)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor of the decoder and its shape (gate and up separately, as saved)."""
        return gate_up_shard_shapes(self.named_parameters())


def check_hybrid_text_config(config: PretrainedConfig) -> None:
    if config.model_type not in SUPPORTED_TEXT_MODEL_TYPES:
        raise UnsupportedModelError(f"text model type {config.model_type!r} is not a hybrid decoder mmengine runs")
    kinds = set(config.layer_types)
    if not kinds <= {LINEAR_ATTENTION, FULL_ATTENTION} or FULL_ATTENTION not in kinds:
        raise UnsupportedModelError(f"layer_types {sorted(kinds)}: need full_attention layers and, besides, only linear_attention")
    if len(config.layer_types) != config.num_hidden_layers:
        raise UnsupportedModelError(f"{len(config.layer_types)} layer_types for {config.num_hidden_layers} layers")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise UnsupportedModelError("linear_num_value_heads must be a multiple of linear_num_key_heads")


class Qwen3_5Model(QwenVLModel):
    language_model: HybridDecoderModel
    decoder_class = HybridDecoderModel

    def enable_mtp(self, num_layers: int) -> None:
        """Builds the checkpoint's multi-token-prediction head (models/qwen3_5_mtp.py), loaded with the model."""
        config = self.language_model.config
        self.mtp = MultiTokenPredictor(config, num_layers, lambda: HybridDecoderLayer(config, FULL_ATTENTION))

    @property
    def draft_head(self) -> nn.Module | None:
        """The multi-token-prediction head (`mtp`), when speculative decoding drafts with it."""
        return self._modules.get("mtp")

    def is_ignorable(self, name: str) -> bool:
        """The published checkpoints carry a multi-token-prediction head (`mtp.*`), used only to draft."""
        return (name.startswith("mtp.") and self.draft_head is None) or super().is_ignorable(name)

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        expected = {n: shape for n, shape in super().expected_weights().items() if not n.startswith("mtp.")}
        if self.draft_head is not None:
            expected.update({f"mtp.{n}": shape for n, shape in self.mtp.checkpoint_shapes().items()})
        return expected

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if not name.startswith("mtp."):
            return super()._load_one(name, tensor)
        if not self.mtp.load_weight(name.removeprefix("mtp."), tensor):
            raise WeightsMismatchError(f"the multi-token-prediction head did not take tensor {name!r}")
