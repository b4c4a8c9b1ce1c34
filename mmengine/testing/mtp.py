"""A random multi-token-prediction head in Qwen3.5's published layout, written into a tiny checkpoint.

transformers skips `mtp.*` when it loads Qwen3.5 (it has no MTP model), so the head's layers are built here
with transformers' own decoder-layer class (`Qwen3_5DecoderLayer`, or the MoE one, as a full-attention
layer) and saved beside the model's weights as `mtp.safetensors`, listed in the safetensors index.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

INDEX = "model.safetensors.index.json"


def mtp_layer_class(text_config):
    """transformers' decoder-layer class of the checkpoint's text model (the head's layers are of its shape)."""
    if text_config.model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

        return Qwen3_5MoeDecoderLayer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    return Qwen3_5DecoderLayer


def random_mtp_tensors(text_config, num_layers: int = 1, seed: int = 0, std: float = 0.2,
                       norm_noise: float = 0.2) -> dict[str, torch.Tensor]:
    """The head's tensors, by checkpoint name: `mtp.fc`, the two pre-fc norms, `mtp.layers.N.*` and
    `mtp.norm`; weights drawn from N(0, std), the zero-centred norms' from N(0, norm_noise)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = text_config.hidden_size
    dtype = getattr(text_config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    def draw(shape, scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * scale).to(dtype)

    tensors = {"mtp.fc.weight": draw((hidden, 2 * hidden), std)}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = draw((hidden,), norm_noise)
    full_attention = text_config.layer_types.index("full_attention")
    layer_class = mtp_layer_class(text_config)
    for i in range(num_layers):
        layer = layer_class(text_config, full_attention)
        for name, param in layer.named_parameters():
            scale = norm_noise if "norm" in name else std
            tensors[f"mtp.layers.{i}.{name}"] = draw(tuple(param.shape), scale)
    return tensors


def add_mtp_head(path: str | os.PathLike, num_layers: int = 1, seed: int = 0, std: float = 0.2) -> pathlib.Path:
    """Writes a random head into the Qwen3.5 checkpoint at `path` (see random_mtp_tensors); returns the path."""
    path = pathlib.Path(path)
    config = AutoConfig.from_pretrained(path)
    text_config = config.text_config
    tensors = random_mtp_tensors(text_config, num_layers, seed, std)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    index = path / INDEX
    if index.exists():
        data = json.loads(index.read_text())
    else:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            data = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    data["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    index.write_text(json.dumps(data, indent=2))
    return path


def tiny_qwen3_5_mtp_path(family: str = "qwen3_5", num_layers: int = 1, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The tiny Qwen3.5 (or Qwen3.5-MoE) test checkpoint with a random MTP head, cached as tiny_qwen_vl_path's."""
    import shutil

    from mmengine.testing.cache import cached_build
    from mmengine.testing.qwen_vl import tiny_qwen_vl_path, tiny_spec

    base = tiny_qwen_vl_path(tiny_spec(family), cache_dir)

    def build(path: pathlib.Path) -> None:
        shutil.copytree(base, path, dirs_exist_ok=True)
        add_mtp_head(path, num_layers)

    return cached_build(f"{base.name}-mtp{num_layers}", build, cache_dir)
