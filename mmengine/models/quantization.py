"""Quantized checkpoints, read from the checkpoint's `quantization_config` (never guessed).

Supported now, dequantized once at load into the model dtype (correct on every device; the quantized
GEMM kernels that keep the weights in 8 bits on a GPU are the next step of this work):
- `quant_method: "fp8"` with `weight_block_size` (Qwen's -FP8 releases): e4m3 weights `W` with one
  scale per block of `weight_block_size` (`weight_scale_inv`, [ceil(out / bo), ceil(in / bi)]):
  w = W * scale[i // bo, j // bi];
- `quant_method: "compressed-tensors"` in the `float-quantized` format (llm-compressor's FP8 exports):
  e4m3 weights with `weight_scale` per output channel ([out, 1]) or per tensor; the activations'
  dynamic scheme needs nothing stored.
Modules the config leaves unquantized (`modules_to_not_convert`, `ignore`) are plain tensors and load
as they are. Anything else (AWQ, GPTQ, int4 `pack-quantized`, an unknown method or field) is an
UnsupportedModelError naming the method and the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mmengine.errors import UnsupportedModelError, WeightsMismatchError

_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
_IGNORED_SUFFIXES = ("input_scale",)  # static activation scales: not used by dequantized weights


@dataclass(frozen=True)
class WeightQuantization:
    method: str  # "fp8" | "compressed-tensors"
    scale_name: str  # the tensor beside each quantized weight: "weight_scale_inv" or "weight_scale"
    block: tuple[int, int] | None  # fp8: (rows, cols) of one scale's block; None: per channel or tensor

    @property
    def label(self) -> str:
        return f"{self.method} (block {self.block[0]}x{self.block[1]})" if self.block else f"{self.method} (per channel / tensor)"


def quantization_of(hf_config: Any) -> WeightQuantization | None:
    """The checkpoint's weight quantization, or None for a plain checkpoint; UnsupportedModelError names
    what is not supported."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if method == "fp8":
        block = config.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise UnsupportedModelError(f"quantization_config.weight_block_size {block!r}: quant_method 'fp8' is supported with "
                                        "block-wise scales (two positive ints, e.g. [128, 128])")
        if config.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedModelError(f"quantization_config.fmt {config.get('fmt')!r}: only e4m3 FP8 is supported")
        return WeightQuantization("fp8", "weight_scale_inv", (block[0], block[1]))
    if method == "compressed-tensors":
        fmt = config.get("format")
        if fmt != "float-quantized":
            raise UnsupportedModelError(f"quantization_config.format {fmt!r} of compressed-tensors is not supported yet "
                                        "(supported: 'float-quantized')")
        for name, group in (config.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8 or weights.get("strategy") not in ("channel", "tensor"):
                raise UnsupportedModelError(f"quantization_config.config_groups.{name}.weights {weights!r}: supported are 8-bit "
                                            "float weights per channel or per tensor")
        return WeightQuantization("compressed-tensors", "weight_scale", None)
    raise UnsupportedModelError(f"quantization_config.quant_method {method!r} is not supported yet "
                                "(supported: 'fp8' with weight_block_size, 'compressed-tensors' float-quantized)")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, spec: WeightQuantization, name: str) -> torch.Tensor:
    """One quantized weight [out, in] and its scale -> float32."""
    w = weight.float()
    if spec.block is None:
        if scale.numel() not in (1, w.shape[0]):
            raise WeightsMismatchError(f"{name}: a scale of {tuple(scale.shape)} for a weight of {tuple(w.shape)} "
                                       "(expected one per output channel, or one)")
        return w * scale.float().reshape(-1, 1) if scale.numel() > 1 else w * scale.float().reshape(())
    rows, cols = spec.block
    expected = (-(-w.shape[0] // rows), -(-w.shape[1] // cols))
    if tuple(scale.shape) != expected:
        raise WeightsMismatchError(f"{name}: a block scale of {tuple(scale.shape)} for a weight of {tuple(w.shape)} in "
                                   f"{rows}x{cols} blocks (expected {expected})")
    full = scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: w.shape[0], : w.shape[1]]
    return w * full


def dequantize_tensors(weights: Iterable[tuple[str, torch.Tensor]], spec: WeightQuantization) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized weight (an 8-bit float `X.weight` with its `X.<scale>`)
    dequantized to float32 under its own name, scales consumed; every other tensor passes through. A
    weight without its scale, or a scale without its weight, is a WeightsMismatchError naming it."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        owner, _, leaf = name.rpartition(".")
        if leaf in _IGNORED_SUFFIXES:
            continue
        if leaf == spec.scale_name:
            if owner in waiting_weights:
                yield f"{owner}.weight", dequantize(waiting_weights.pop(owner), tensor, spec, f"{owner}.weight")
            else:
                waiting_scales[owner] = tensor
            continue
        if leaf in _SCALE_SUFFIXES:
            raise WeightsMismatchError(f"tensor {name!r}: a {spec.method} checkpoint stores its scales as {spec.scale_name!r}")
        if leaf == "weight" and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if owner in waiting_scales:
                yield name, dequantize(tensor, waiting_scales.pop(owner), spec, name)
            else:
                waiting_weights[owner] = tensor
            continue
        yield name, tensor
    if waiting_weights or waiting_scales:
        lost = [f"{o}.weight (no {spec.scale_name})" for o in waiting_weights] + [f"{o}.{spec.scale_name} (no weight)" for o in waiting_scales]
        raise WeightsMismatchError(f"unpaired quantized tensors: {', '.join(lost[:8])}")
