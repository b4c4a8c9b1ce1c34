"""Gemma 4's decoder (transformers' Gemma4TextModel) over the paged KV cache.

What sets it apart from a Llama-family decoder, each as transformers 5 defines it:
- `layer_types`: most layers attend within a sliding window of the last `sliding_window` tokens, every
  few a layer is global; the two kinds have their own head size and KV heads (`per_layer_config`, or
  an older config's `global_head_dim` / `num_global_key_value_heads`) and their own RoPE (plain on the
  sliding layers; "proportional" on the global ones: only the first quarter of the frequencies turn);
- with `use_bidirectional_attention="vision"`, a picture's soft tokens see each other both ways on the
  sliding layers (AttentionMetadata.span_ends says how far each token sees);
- q, k and v are RMS-normed per head (v without a weight); attention is unscaled (scale 1.0);
  `attention_k_eq_v` global layers take V from the raw k_proj output (no v_proj);
- the last `num_kv_shared_layers` layers store no K/V: each reads the cache of the last earlier layer
  of its kind, and (`use_double_wide_mlp`) has an MLP twice as wide;
- per-layer input embeddings (`hidden_size_per_layer_input`): a second embedding of the token ids and
  a projection of the input embeddings, one slice per layer, gated into the stream after the MLP;
- every layer's output is scaled by its `layer_scalar`; the embeddings by sqrt(hidden) (in the weight
  dtype); the logits are soft-capped (`final_logit_softcapping`);
- the MoE block (`enable_moe_block`) runs beside the dense MLP, its router reading the residual.
Norms are Gemma 4's (ScaledRMSNorm: x normalised and multiplied by the weight in float32).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.layers.activation import activation_module
from mmengine.layers.attention import Attention, AttentionMetadata
from mmengine.layers.kernel_dispatch import use_fused_kernels
from mmengine.layers.lora import LoRAContext, LoRALinear
from mmengine.layers.moe import FusedExperts
from mmengine.layers.norm import ScaledRMSNorm
from mmengine.layers.rotary import RotaryStep, apply_rotary, build_cos_sin_table
from mmengine.models.gemma4_layers import LayerAttention, layer_attention
from mmengine.models.llama import DeepStack, copy_checked, gate_up_shard_shapes, load_with_gate_up_shards
from mmengine.models.text_config import FULL, SLIDING

SUPPORTED_TEXT_MODEL_TYPES = ("gemma4_text",)


def check_text_config(config: PretrainedConfig) -> None:
    if config.model_type not in SUPPORTED_TEXT_MODEL_TYPES:
        raise UnsupportedModelError(f"text model type {config.model_type!r} is not Gemma 4's decoder")
    kinds = set(config.layer_types)
    if not kinds <= {SLIDING, FULL}:
        raise UnsupportedModelError(f"layer_types {sorted(kinds)}: Gemma 4 has sliding_attention and full_attention layers")
    if len(config.layer_types) != config.num_hidden_layers:
        raise UnsupportedModelError(f"{len(config.layer_types)} layer_types for {config.num_hidden_layers} layers")
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    if bidirectional not in (None, "vision"):
        raise UnsupportedModelError(f"use_bidirectional_attention={bidirectional!r} (an encoder) is not a decoder mmengine runs")
    for layer in layer_attention(config):
        if config.num_attention_heads % layer.num_kv_heads:
            raise UnsupportedModelError(f"num_attention_heads {config.num_attention_heads} is not a multiple of {layer.num_kv_heads} KV heads")


def rope_inv_freq_of(config: PretrainedConfig, kind: str, head_dim: int) -> torch.Tensor:
    """The inverse frequencies of a layer kind: plain RoPE, or "proportional" (the first
    partial_rotary_factor of the head's frequency pairs turn, at exponents over the whole head; the
    rest stay still), as transformers' _compute_proportional_rope_parameters."""
    params = (getattr(config, "rope_parameters", None) or {}).get(kind) or {}
    rope_type = params.get("rope_type", "default")
    base = params.get("rope_theta", 10000.0)
    if rope_type == "default":
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope_type != "proportional":
        raise UnsupportedModelError(f"rope_type {rope_type!r} on Gemma 4's {kind} layers is not supported")
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    turning = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat([turning, torch.zeros(head_dim // 2 - angles)])
    return inv_freq / params.get("factor", 1.0)


class Gemma4Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: LayerAttention) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads, self.head_dim = layer.num_kv_heads, layer.head_dim
        self.kind = layer.kind
        sliding = layer.kind == SLIDING
        eps = config.rms_norm_eps
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.q_norm = ScaledRMSNorm(self.head_dim, eps)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.stores_kv = layer.stores_kv
        if self.stores_kv:
            self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
            k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and not sliding
            self.v_proj = None if k_eq_v else nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
            self.k_norm = ScaledRMSNorm(self.head_dim, eps)
            self.v_norm = ScaledRMSNorm(self.head_dim, eps, with_weight=False)
        spans = sliding and getattr(config, "use_bidirectional_attention", None) == "vision"
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=1.0,
                              sliding_window=config.sliding_window if sliding else None, bidirectional_spans=spans)

    def forward(self, x: torch.Tensor, rotary: RotaryStep, metadata: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(tokens, self.num_heads, self.head_dim))
        if not self.stores_kv:  # reads an earlier layer's cache (bound by the decoder)
            return self.o_proj(self.attn(apply_rotary(q, rotary.cos, rotary.sin), None, None, metadata))
        raw_k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        raw_v = raw_k if self.v_proj is None else self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, self.k_norm(raw_k), self.v_norm(raw_v), metadata, rotary))


class Gemma4MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = activation_module(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def load_shard(self, shard: int, param: str, tensor: torch.Tensor) -> None:
        n = self.intermediate_size
        copy_checked(getattr(self.gate_up_proj, param).data[shard * n:(shard + 1) * n], tensor, f"gate_up_proj.{param}[{shard}]")


class Gemma4Router(nn.Module):
    """Softmax top-k over the experts of a normalised, scaled residual; the chosen weights renormalised,
    then multiplied by each expert's own scale."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.top_k = config.top_k_experts
        self.norm = ScaledRMSNorm(config.hidden_size, config.rms_norm_eps, with_weight=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.root_size = config.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int, layer: LayerAttention) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer)
        wide = bool(getattr(config, "use_double_wide_mlp", False)) and not layer.stores_kv
        self.mlp = Gemma4MLP(hidden, config.intermediate_size * (2 if wide else 1), config.hidden_activation)
        self.input_layernorm = ScaledRMSNorm(hidden, eps)
        self.post_attention_layernorm = ScaledRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = ScaledRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = ScaledRMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.per_layer_width = config.hidden_size_per_layer_input or 0
        if self.per_layer_width:
            self.act = activation_module(config.hidden_activation)
            self.per_layer_input_gate = nn.Linear(hidden, self.per_layer_width, bias=False)
            self.per_layer_projection = nn.Linear(self.per_layer_width, hidden, bias=False)
            self.post_per_layer_input_norm = ScaledRMSNorm(hidden, eps)
        self.has_moe = bool(getattr(config, "enable_moe_block", False))
        if self.has_moe:
            self.router = Gemma4Router(config)
            self.experts = FusedExperts(config.num_experts, hidden, config.moe_intermediate_size, config.hidden_activation,
                                        config.top_k_experts)
            self.post_feedforward_layernorm_1 = ScaledRMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = ScaledRMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = ScaledRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, rotary: RotaryStep,
                metadata: AttentionMetadata, fused: bool = False) -> torch.Tensor:
        """`fused`: the experts run the fused MoE kernel."""
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, metadata))
        residual = x + h
        h = self.mlp(self.pre_feedforward_layernorm(residual))
        if self.has_moe:
            weights, experts = self.router(residual)
            routed = self.experts(self.pre_feedforward_layernorm_2(residual), weights, experts, use_kernel=fused)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = residual + self.post_feedforward_layernorm(h)
        if self.per_layer_width:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class ScaledEmbedding(nn.Embedding):
    """An embedding multiplied by a constant rounded to the weight's dtype first (transformers' Gemma
    rounds sqrt(hidden) so)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * float(torch.tensor(self.scale).to(self.weight.dtype))


class Gemma4DecoderModel(nn.Module):
    """Embeddings (and the per-layer ones), layers, final norm; the LM head lives with the VLM."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_text_config(config)
        self.config = config
        self.layer_attention = layer_attention(config)
        self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, config.hidden_size**0.5)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i, layer) for i, layer in enumerate(self.layer_attention))
        self.norm = ScaledRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.per_layer_width = config.hidden_size_per_layer_input or 0
        if self.per_layer_width:
            width = config.num_hidden_layers * self.per_layer_width
            self.embed_tokens_per_layer = ScaledEmbedding(config.vocab_size_per_layer_input, width, self.per_layer_width**0.5)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection_norm = ScaledRMSNorm(self.per_layer_width, config.rms_norm_eps)
        # One cos/sin table per layer kind (their head sizes and frequencies differ)
        self.rotary_tables = {}
        for kind in (SLIDING, FULL):
            dims = {layer.head_dim for layer in self.layer_attention if layer.kind == kind}
            for head_dim in dims:
                table = build_cos_sin_table(rope_inv_freq_of(config, kind, head_dim).to(torch.get_default_device()), 1.0,
                                            config.max_position_embeddings, torch.get_default_dtype())
                self.register_buffer(f"{kind}_cos_sin", table, persistent=False)
                self.rotary_tables[kind] = f"{kind}_cos_sin"
        for layer, shape in zip(self.layers, self.layer_attention):
            if not shape.stores_kv:
                layer.self_attn.attn.read_cache_of(self.layers[shape.kv_source].self_attn.attn)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.placeholder_ids: tuple[int, ...] = ()  # multimodal soft tokens: their per-layer inputs use the pad row
        self.pad_token_id = config.pad_token_id or 0

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                deepstack: DeepStack | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        backend = self.attention_layers()[0].backend
        fused = use_fused_kernels(inputs_embeds.device, backend.name if backend is not None else None)
        # the PyTorch rotation on every path: KV-shared layers rotate their queries alone
        rotary = {kind: RotaryStep.gather(positions, getattr(self, name), use_kernel=False) for kind, name in self.rotary_tables.items()}
        per_layer = self._per_layer_inputs(input_ids, inputs_embeds) if self.per_layer_width else None
        x = inputs_embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, None if per_layer is None else per_layer[:, index], rotary[self.layer_attention[index].kind], metadata, fused)
        return self.norm(x)

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids the embeddings read: every multimodal placeholder as the pad token, as transformers' Gemma 4
        does (`get_placeholder_mask`, then the pad id in its place) whether or not an item stands behind it."""
        ids = input_ids
        for placeholder in self.placeholder_ids:
            ids = torch.where(ids == placeholder, self.pad_token_id, ids)
        return ids

    def _per_layer_inputs(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, width]: (the token ids' per-layer embedding + the normed projection of the input
        embeddings) / sqrt(2); soft tokens take the pad token's per-layer embedding."""
        if input_ids is None:
            raise ValueError("Gemma 4's per-layer inputs need the step's token ids")
        ids = self.text_ids(input_ids)
        shape = (inputs_embeds.shape[0], self.config.num_hidden_layers, self.per_layer_width)
        tokens = self.embed_tokens_per_layer(ids).reshape(shape)
        context = self.per_layer_model_projection(inputs_embeds) * self.config.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.reshape(shape))
        return (context + tokens) * 2.0**-0.5

    def softcap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.softcap:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def attention_layers(self) -> list[Attention]:
        """The layers that keep a KV cache, in order (a KV-shared layer reads its source's)."""
        return [layer.self_attn.attn for layer, shape in zip(self.layers, self.layer_attention) if shape.stores_kv]

    def kv_cache_layout(self) -> list[tuple[int, int]]:
        return [(shape.num_kv_heads, shape.head_dim) for shape in self.layer_attention if shape.stores_kv]

    def enable_lora(self, max_loras: int, max_rank: int) -> LoRAContext:
        raise UnsupportedModelError("LoRA adapters are not supported on Gemma 4's decoder yet")

    def lora_modules(self) -> list[tuple[int, LoRALinear]]:
        return []

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Loads one checkpoint tensor named relative to this module; False if the name is unknown."""
        return load_with_gate_up_shards(self, name, tensor)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor of the decoder and its shape (gate and up separately, as saved)."""
        scalars = ((n, b) for n, b in self.named_buffers() if n.endswith("layer_scalar"))
        return gate_up_shard_shapes([*self.named_parameters(), *scalars])

