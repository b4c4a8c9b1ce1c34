"""Random LoRA adapters in PEFT's on-disk format, for benchmarks and fuzzing (no `peft` needed).

The files are what `peft`'s save_pretrained writes for a LoRA on the language model's projections
with transformers 5's key layout (`base_model.model.model.language_model.layers.N...`); the tests that
compare with transformers + PEFT build theirs with `peft` itself.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_random_adapter(
    base_model_dir: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    rank: int,
    targets: Sequence[str] = PROJECTIONS,
    alpha: float | None = None,
    seed: int = 0,
    scale: float = 0.02,
    dtype: str = "float32",
) -> pathlib.Path:
    """Writes an adapter of `rank` on `targets` of every decoder layer of the checkpoint at
    `base_model_dir`, with N(0, scale) weights in A and B; returns its directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(str(base_model_dir)).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    q, kv = text.num_attention_heads * head_dim, text.num_key_value_heads * head_dim
    features = {"q_proj": (text.hidden_size, q), "k_proj": (text.hidden_size, kv), "v_proj": (text.hidden_size, kv),
                "o_proj": (q, text.hidden_size), "gate_proj": (text.hidden_size, text.intermediate_size),
                "up_proj": (text.hidden_size, text.intermediate_size), "down_proj": (text.intermediate_size, text.hidden_size)}
    unknown = sorted(set(targets) - set(PROJECTIONS))
    if unknown:
        raise ValueError(f"unknown target projections {unknown}; choose from {PROJECTIONS}")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(text.num_hidden_layers):
        for proj in targets:
            block = "self_attn" if proj in _ATTENTION else "mlp"
            fan_in, fan_out = features[proj]
            key = f"base_model.model.model.language_model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) * scale).to(getattr(torch, dtype))
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * scale).to(getattr(torch, dtype))
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank, "bias": "none",
              "use_dora": False, "use_rslora": False, "target_modules": list(targets), "base_model_name_or_path": str(base_model_dir)}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out
