"""An EAGLE-3 draft head (speculative_config method "eagle3"), in the layout the published heads use
(SpecForge / vLLM's `LlamaForCausalLMEagle3`, `Eagle3Qwen2_5vlForCausalLM`, `Eagle3Qwen3vlForCausalLM`).

The head reads the target's residual stream at the inputs of three decoder layers (the config's
`eagle_config.eagle_aux_hidden_state_layer_ids`, else vLLM's default: layers 2, L/2 and L-3), fused by `fc`:

    h = fc(cat(stream before layer a, before layer b, before layer c))          [3 x target hidden -> hidden]
    x = cat(input_layernorm(embed(t[j+1])), hidden_norm(h))                     [2 x hidden]
    x = o_proj(attention(q_proj(x), k_proj(x), v_proj(x))) + h                  (h before its norm: the residual)
    x = mlp(post_attention_layernorm(x)) + x
    draft = d2t-mapped argmax(lm_head(norm(x)))                                  (a draft vocabulary of its own)

Chained, the next draft step reads the previous step's stream before `norm` in place of fc's output. The
head's one layer attends over K/V of its own, kept in the paged KV cache after the target's layers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from mmengine.errors import ConfigError, WeightsMismatchError
from mmengine.layers.attention import Attention, AttentionMetadata
from mmengine.layers.norm import RMSNorm
from mmengine.layers.rotary import RotaryEmbedding, RotaryStep
from mmengine.models.llama import DecoderMLP, copy_checked, gate_up_shard_shapes, head_dim_of
from mmengine.models.loader import WeightCheck, iter_checkpoint


def load_eagle3_config(model_dir: str) -> PretrainedConfig:
    """The head's config; a directory without one is a ConfigError naming speculative_config['model']."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(f"speculative_config['model']={model_dir!r}: no EAGLE-3 head there (no config.json)")
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "num_hidden_layers", 1) != 1:
        raise ConfigError(f"speculative_config['model']={model_dir!r}: an EAGLE-3 head has one decoder layer, this config "
                          f"says {config.num_hidden_layers}")
    return config


def aux_layer_ids(config: PretrainedConfig, num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs the head reads."""
    ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_target_layers for i in ids):
        raise ConfigError(f"speculative_config['model']: eagle_aux_hidden_state_layer_ids {ids} must name three of the "
                          f"target's {num_target_layers} layers")
    return tuple(int(i) for i in ids)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read twice the hidden size (the token's embedding beside the hidden state)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, rotary: RotaryStep, metadata: AttentionMetadata) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, metadata, rotary))


class Eagle3Layer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = Eagle3Attention(config)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary: RotaryStep, metadata: AttentionMetadata,
                fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden, use_kernel=fused)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds, use_kernel=fused), normed], dim=-1)
        h, residual = self.post_attention_layernorm(self.self_attn(x, rotary, metadata), residual, use_kernel=fused)
        return self.mlp(h, fused), residual


class Eagle3Head(nn.Module):
    def __init__(self, config: PretrainedConfig, target_hidden: int, own_embeddings: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embeddings else None
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        # draft token d is target token d + d2t[d] (absent: the vocabularies are one)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.rotary = RotaryEmbedding(config, head_dim_of(config))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed output the LM head reads, the stream before the norm: the next draft step's hidden)."""
        x, residual = self.midlayer(embeds, hidden, self.rotary.step(positions, use_kernel=False), metadata, fused)
        return self.norm(x, residual, use_kernel=fused)

    def greedy(self, output: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(output).argmax(dim=-1)
        return draft + self.d2t[draft]

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = gate_up_shard_shapes(self.named_parameters())
        shapes["d2t"] = (self.draft_vocab_size,)
        return shapes

    def load(self, model_dir: str) -> None:
        """Every tensor of the head's checkpoint exactly once (`t2d`, the inverse map, is not needed; `d2t`
        only when the draft vocabulary is smaller)."""
        optional = ["d2t"] if self.draft_vocab_size == self.config.vocab_size else []
        check = WeightCheck(self.checkpoint_shapes(), (source := iter_checkpoint(Path(model_dir))), optional=optional)
        for raw_name, tensor in source:
            name = head_parameter_name(raw_name)
            if name == "t2d":
                continue
            check.accept(name, raw_name, tensor)
            with torch.no_grad():
                self._load_one(name, tensor)
        check.finish()

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.split(".")
        if name == "d2t":
            self.d2t.copy_(tensor.to(torch.long))
        elif parts[-2] in ("gate_proj", "up_proj"):
            self.midlayer.mlp.load_shard(("gate_proj", "up_proj").index(parts[-2]), parts[-1], tensor)
        else:
            copy_checked(self.get_parameter(name).data, tensor, name)


def head_parameter_name(raw_name: str) -> str:
    """The head's parameter a draft checkpoint's tensor loads into."""
    name = raw_name.removeprefix("model.")
    if name.startswith("layers.0."):  # some exports name the one layer as a decoder's first
        name = "midlayer." + name.removeprefix("layers.0.")
    return name


def has_own_embeddings(model_dir: str) -> bool:
    from mmengine.models.loader import checkpoint_shapes

    return any(head_parameter_name(n) == "embed_tokens.weight" for n in checkpoint_shapes(Path(model_dir)))


def check_draft_fits(config: PretrainedConfig, model_dir: str, target_config: PretrainedConfig) -> None:
    """The head must speak the target's vocabulary and read its hidden size."""
    if config.vocab_size != target_config.vocab_size:
        raise ConfigError(f"speculative_config['model']={model_dir!r}: the draft's vocabulary has {config.vocab_size} "
                          f"tokens, the target's {target_config.vocab_size}")
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    if target_hidden != target_config.hidden_size:
        raise ConfigError(f"speculative_config['model']={model_dir!r}: the draft reads hidden states of size {target_hidden}, "
                          f"the target's are {target_config.hidden_size}")
    if not has_own_embeddings(model_dir) and config.hidden_size != target_config.hidden_size:
        raise WeightsMismatchError(f"the EAGLE-3 head in {model_dir} has no embed_tokens and a hidden size "
                                   f"({config.hidden_size}) other than the target's ({target_config.hidden_size})")
