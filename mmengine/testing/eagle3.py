"""A random EAGLE-3 draft head for a test checkpoint, in the layout the published heads use (SpecForge's
export, read by vLLM as `LlamaForCausalLMEagle3`): a Llama config with `draft_vocab_size`,
`target_hidden_size` and `eagle_config`, and `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d` (and
optionally `embed_tokens`) in model.safetensors."""

from __future__ import annotations

import os
import pathlib

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, LlamaConfig


def build_eagle3_head(path: str | os.PathLike, target: str | os.PathLike, *, hidden_size: int | None = None,
                      draft_vocab_size: int | None = None, own_embeddings: bool = False,
                      aux_layer_ids: tuple[int, int, int] | None = None, seed: int = 0, std: float = 0.2) -> pathlib.Path:
    """Writes a random head for the checkpoint at `target` into `path`; returns the path. `draft_vocab_size`
    below the target's picks that many target tokens (d2t maps them back); `hidden_size` other than the
    target's needs `own_embeddings`."""
    path = pathlib.Path(path)
    target_config = AutoConfig.from_pretrained(target)
    text = getattr(target_config, "text_config", target_config)
    hidden = hidden_size or text.hidden_size
    # the target's attention shape, as the published heads have it
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    head_dim, intermediate = hidden // heads, text.intermediate_size
    config = LlamaConfig(vocab_size=text.vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6,
                         max_position_embeddings=text.max_position_embeddings, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.draft_vocab_size = draft_vocab_size or text.vocab_size
    config.target_hidden_size = text.hidden_size
    layers = text.num_hidden_layers  # vLLM's default (2, L/2, L-3) needs 4 layers: a tiny target names its own
    ids = aux_layer_ids or ((2, layers // 2, layers - 3) if layers >= 4 else (0, layers // 2, layers - 1))
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float = std, offset: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * scale + offset

    tensors = {
        "fc.weight": draw(hidden, 3 * text.hidden_size),
        "midlayer.self_attn.q_proj.weight": draw(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": draw(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": draw(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": draw(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": draw(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": draw(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": draw(hidden, intermediate),
        "lm_head.weight": draw(config.draft_vocab_size, hidden),
    }
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{name}.weight"] = draw(hidden, scale=0.2, offset=1.0)
    if own_embeddings:
        tensors["embed_tokens.weight"] = draw(text.vocab_size, hidden)
    if config.draft_vocab_size < text.vocab_size:
        kept = torch.randperm(text.vocab_size, generator=generator)[: config.draft_vocab_size].sort().values
        tensors["d2t"] = kept - torch.arange(config.draft_vocab_size)
        t2d = torch.zeros(text.vocab_size, dtype=torch.bool)
        t2d[kept] = True
        tensors["t2d"] = t2d
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
