"""Quantized copies of tiny checkpoints, in the layouts the formats document, for the loading tests:

- `fp8` (Qwen's -FP8 releases): every decoder linear weight as float8_e4m3fn with a float32
  `weight_scale_inv` per `block` (amax / 448 of the block), `quantization_config` {"quant_method":
  "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block};
- `compressed-tensors` float-quantized (llm-compressor's FP8-Dynamic): float8_e4m3fn weights with a
  `weight_scale` per output channel ([out, 1]), the vision side and lm_head in `ignore`.

Each also writes, beside it, the same model with the dequantized weights (q x scale, computed here in
float32) as a plain checkpoint: what the quantized one must compute exactly.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0


def _quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = block
    out_blocks, in_blocks = -(-weight.shape[0] // rows), -(-weight.shape[1] // cols)
    scale = torch.empty(out_blocks, in_blocks)
    w = weight.float()
    for i in range(out_blocks):
        for j in range(in_blocks):
            tile = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: w.shape[0], : w.shape[1]]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _quantize_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * scale


def _quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The decoder's linear weights (not embeddings, norms, the vision side or lm_head), in either key
    layout (`model.language_model.layers.*`, or the original Qwen-VL `model.layers.*`)."""
    return tensor.ndim == 2 and name.endswith(".weight") and ".layers." in name and "visual" not in name \
        and "vision_tower" not in name and "norm" not in name


def quantize_checkpoint(source: str | pathlib.Path, target: str | pathlib.Path, method: str = "fp8",
                        block: tuple[int, int] = (32, 32)) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes the quantized copy of the single-file checkpoint `source` to `target`, and the dequantized
    reference to `target` + "-dequantized"; returns both paths."""
    source, target = pathlib.Path(source), pathlib.Path(target)
    reference = target.with_name(target.name + "-dequantized")
    for directory in (target, reference):
        shutil.copytree(source, directory, dirs_exist_ok=True)
    tensors = load_file(str(source / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if not _quantizable(name, tensor):
            quantized[name] = dequantized[name] = tensor
            continue
        owner = name.removesuffix(".weight")
        if method == "fp8":
            q, scale, exact = _quantize_blocks(tensor, block)
            quantized[f"{owner}.weight_scale_inv"] = scale
        elif method == "compressed-tensors":
            q, scale, exact = _quantize_channels(tensor)
            quantized[f"{owner}.weight_scale"] = scale
        else:
            raise ValueError(f"unknown method {method!r}")
        quantized[name] = q
        dequantized[name] = exact.to(tensor.dtype)
    save_file(quantized, str(target / "model.safetensors"))
    save_file(dequantized, str(reference / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    if method == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}
    else:
        scheme = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                          "input_activations": {**scheme, "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head", "re:.*visual.*", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
        }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target, reference
