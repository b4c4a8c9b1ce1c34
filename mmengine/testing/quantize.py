"""Quantized copies of tiny checkpoints, in the layouts the formats document, for the loading tests:

- `fp8` (Qwen's -FP8 releases): every decoder linear weight as float8_e4m3fn with a float32
  `weight_scale_inv` per `block` (amax / 448 of the block), `quantization_config` {"quant_method":
  "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block};
- `compressed-tensors` float-quantized (llm-compressor's FP8-Dynamic): float8_e4m3fn weights with a
  `weight_scale` per output channel ([out, 1]), the vision side and lm_head in `ignore`.

- `gptq` (v1 format, 4 bits): `qweight` [in / 8, out] packed along the input (nibble i of a word is
  row 8r + i), `qzeros` [groups, out / 8] packed along the output and stored minus one, `scales`
  [groups, out] fp16, `g_idx` [in]; with act_order the rows are assigned to groups in a shuffled order;
- `w4a16` / `w4a16-asym` (compressed-tensors pack-quantized, llm-compressor's W4A16): int4 weights per
  group of 32 inputs packed by compressed-tensors' own `pack_to_int32`, `weight_scale` [out, groups],
  `weight_shape`, and for the asymmetric scheme `weight_zero_point` packed along the output;
- `awq` (GEMM packing, 4 bits): `qweight` [in, out / 8] and `qzeros` [groups, out / 8] packed along the
  output with AutoAWQ's nibble order (0, 2, 4, 6, 1, 3, 5, 7), `scales` [groups, out] fp16.

Each also writes, beside it, the same model with the dequantized weights (computed here in float32
from the integer values, before any packing) as a plain checkpoint: what the quantized one must
compute exactly (`reference=False` skips it: the GPU suite quantizes 7B checkpoints, shard by shard,
on the GPU).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import torch
from safetensors.torch import load_file, save_file

from mmengine.models.quantization import pack_int4

FP8_MAX = 448.0


def _quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = block
    out_blocks, in_blocks = -(-weight.shape[0] // rows), -(-weight.shape[1] // cols)
    w = weight.float()
    padded = torch.nn.functional.pad(w.abs(), (0, in_blocks * cols - w.shape[1], 0, out_blocks * rows - w.shape[0]))
    scale = padded.view(out_blocks, rows, in_blocks, cols).amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: w.shape[0], : w.shape[1]]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _quantize_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * scale


def _int4_groups(weight: torch.Tensor, groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric 4-bit quantization of W^T [in, out], rows grouped by `groups` [in]: returns q [in, out],
    zeros and scales [num_groups, out] (scales rounded to fp16, as stored) and the dequantized W [out, in]."""
    w = weight.float().t()
    index = groups.long().to(w.device)[:, None].expand_as(w)
    lo = torch.zeros(num_groups, w.shape[1], device=w.device).scatter_reduce(0, index, w, "amin")  # <= 0: the zeros start there
    hi = torch.zeros(num_groups, w.shape[1], device=w.device).scatter_reduce(0, index, w, "amax")
    scales = ((hi - lo).clamp(min=1e-8) / 15).half().float()
    zeros = (-lo / scales).round().clamp(1, 15)  # >= 1: GPTQ v1 stores zero - 1 in a nibble
    q = (w / scales[groups] + zeros[groups]).round().clamp(0, 15)
    return q.to(torch.int32), zeros.to(torch.int32), scales, ((q - zeros[groups]) * scales[groups]).t()


def _int4_signed_groups(weight: torch.Tensor, group_size: int, symmetric: bool) -> tuple[torch.Tensor, ...]:
    """compressed-tensors' int4 scheme per group of inputs: q in [-8, 7] as int8, scales [out, groups],
    zero points [out, groups] int8 (None when symmetric), and the dequantized weight (q - zero) x scale."""
    w = weight.float()
    grouped = w.view(w.shape[0], -1, group_size)
    if symmetric:
        scales = (grouped.abs().amax(-1) / 7).clamp(min=1e-8)
        zeros = torch.zeros_like(scales)
    else:
        lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = (-8 - lo / scales).round().clamp(-8, 7)
    scales = scales.to(weight.dtype).float()  # stored in the model dtype
    q = (grouped / scales[..., None] + zeros[..., None]).round().clamp(-8, 7)
    exact = ((q - zeros[..., None]) * scales[..., None]).reshape(w.shape)
    return (q.reshape(w.shape).to(torch.int8), scales.to(weight.dtype),
            None if symmetric else zeros.to(torch.int8), exact)


def _quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The decoder's linear weights (not embeddings, norms, the vision side or lm_head), in either key
    layout (`model.language_model.layers.*`, or the original Qwen-VL `model.layers.*`)."""
    return tensor.ndim == 2 and name.endswith(".weight") and ".layers." in name and "visual" not in name \
        and "vision_tower" not in name and "norm" not in name


def quantize_checkpoint(source: str | pathlib.Path, target: str | pathlib.Path, method: str = "fp8",
                        block: tuple[int, int] = (32, 32), group_size: int = 32, reference: bool = True,
                        device: str = "cpu") -> tuple[pathlib.Path, pathlib.Path | None]:
    """Writes the quantized copy of the checkpoint `source` (one file or shards) to `target`, and the
    dequantized reference to `target` + "-dequantized" (unless reference=False); returns both paths.
    The arithmetic runs on `device`."""
    source, target = pathlib.Path(source), pathlib.Path(target)
    deq_dir = target.with_name(target.name + "-dequantized") if reference else None
    for directory in (target, deq_dir) if deq_dir else (target,):
        shutil.copytree(source, directory, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    names: dict[str, str] = {}  # tensor -> its shard, for a sharded checkpoint's index
    for shard in sorted(source.glob("*.safetensors")):
        quantized, dequantized = _quantize_tensors(load_file(str(shard), device=device), method, block, group_size, reference)
        save_file({k: v.cpu().contiguous() for k, v in quantized.items()}, str(target / shard.name), metadata={"format": "pt"})
        if deq_dir:
            save_file({k: v.cpu().contiguous() for k, v in dequantized.items()}, str(deq_dir / shard.name), metadata={"format": "pt"})
        names.update({name: shard.name for name in quantized})
    if (source / "model.safetensors.index.json").is_file():
        (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}, indent=1))
        if deq_dir:
            shutil.copy(source / "model.safetensors.index.json", deq_dir)
    _write_quantization_config(target, method, block, group_size)
    return target, deq_dir


def _quantize_tensors(tensors: dict[str, torch.Tensor], method: str, block: tuple[int, int], group_size: int,
                      reference: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        int4 = method in ("w4a16", "w4a16-asym", "gptq", "gptq-act-order", "awq")
        if not _quantizable(name, tensor) or (int4 and (tensor.shape[0] % 8 or tensor.shape[1] % group_size)):
            # (4-bit packing needs outputs by 8s and whole groups: such small projections, e.g. a router of
            # 4 rows, stay dense, as quantizers leave them)
            quantized[name] = dequantized[name] = tensor
            continue
        owner = name.removesuffix(".weight")
        if method in ("w4a16", "w4a16-asym"):
            q, scales, zeros, exact = _int4_signed_groups(tensor, group_size, symmetric=method == "w4a16")
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # the format's own packer

            quantized[f"{owner}.weight_packed"] = pack_to_int32(q, 4)
            quantized[f"{owner}.weight_scale"] = scales
            quantized[f"{owner}.weight_shape"] = torch.tensor(tensor.shape)
            if zeros is not None:
                quantized[f"{owner}.weight_zero_point"] = pack_to_int32(zeros, 4, packed_dim=0)
            if reference:
                dequantized[name] = exact.to(tensor.dtype)
            continue
        if method in ("gptq", "gptq-act-order", "awq"):
            rows = tensor.shape[1]
            num_groups = rows // group_size
            groups = torch.arange(rows) // group_size
            if method == "gptq-act-order":
                groups = groups[torch.randperm(rows, generator=torch.Generator().manual_seed(rows))]
            groups = groups.to(tensor.device)
            q, zeros, scales, exact = _int4_groups(tensor, groups, num_groups)
            if method == "awq":
                awq_order = (0, 2, 4, 6, 1, 3, 5, 7)
                quantized[f"{owner}.qweight"] = pack_int4(q, 1, awq_order)
                quantized[f"{owner}.qzeros"] = pack_int4(zeros, 1, awq_order)
            else:
                quantized[f"{owner}.qweight"] = pack_int4(q, 0)
                quantized[f"{owner}.qzeros"] = pack_int4(zeros - 1, 1)
                quantized[f"{owner}.g_idx"] = groups.to(torch.int32)
            quantized[f"{owner}.scales"] = scales.half()
            if reference:
                dequantized[name] = exact.to(tensor.dtype)
            continue
        if method == "fp8":
            q, scale, exact = _quantize_blocks(tensor, block)
            quantized[f"{owner}.weight_scale_inv"] = scale
        elif method == "compressed-tensors":
            q, scale, exact = _quantize_channels(tensor)
            quantized[f"{owner}.weight_scale"] = scale
        else:
            raise ValueError(f"unknown method {method!r}")
        quantized[name] = q
        if reference:
            dequantized[name] = exact.to(tensor.dtype)
    return quantized, dequantized


def _write_quantization_config(target: pathlib.Path, method: str, block: tuple[int, int], group_size: int) -> None:
    config = json.loads((target / "config.json").read_text())
    if method in ("w4a16", "w4a16-asym"):
        scheme = {"num_bits": 4, "type": "int", "symmetric": method == "w4a16", "strategy": "group", "group_size": group_size,
                  "dynamic": False}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": None}},
            "ignore": ["lm_head", "re:.*visual.*", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
        }
    elif method in ("gptq", "gptq-act-order"):
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": False,
                                         "desc_act": method == "gptq-act-order", "checkpoint_format": "gptq"}
    elif method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
                                         "zero_point": True}
    elif method == "fp8":
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
