"""Quantized checkpoints, read from the checkpoint's `quantization_config` (never guessed).

Supported, dequantized once at load into the model dtype (correct on every device); where the fused
kernels run, the decoder's projections keep their 8- or 4-bit weights instead (PackedFp8, PackedInt4:
layers/quantized_linear.py):
- `quant_method: "fp8"` with `weight_block_size` (Qwen's -FP8 releases): e4m3 weights `W` with one
  scale per block of `weight_block_size` (`weight_scale_inv`, [ceil(out / bo), ceil(in / bi)]):
  w = W * scale[i // bo, j // bi];
- `quant_method: "compressed-tensors"` in the `float-quantized` format (llm-compressor's FP8 exports):
  e4m3 weights with `weight_scale` per output channel ([out, 1]) or per tensor; the activations'
  dynamic scheme needs nothing stored.
- `quant_method: "compressed-tensors"` in the `pack-quantized` format (W4A16): int4 weights per group or
  channel, symmetric or with zero points;
- `quant_method: "gptq"` (4 bits, the v1 `gptq` checkpoint format, any group size; `desc_act` too: each
  input row's group comes from `g_idx`) and `"awq"` (4 bits, GEMM packing).
Modules the config leaves unquantized (`modules_to_not_convert`, `ignore`) are plain tensors and load
as they are. Anything else (other bit widths or formats, an unknown method or field) is an
UnsupportedModelError naming the method and the field.
An FP8 checkpoint that declares dynamic activations (`activation_scheme: "dynamic"`, or dynamic 8-bit
float `input_activations`) says so in `activations_dynamic`: its prefill-shaped steps may run W8A8
(layers/fp8_dispatch.py). Static input scales (`input_scale`) are ignored: those run W8A16.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from mmengine.errors import UnsupportedModelError, WeightsMismatchError

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
IGNORED_SUFFIXES = ("input_scale",)  # static activation scales: unused (such checkpoints run W8A16)


@dataclass(frozen=True)
class WeightQuantization:
    method: str  # "fp8" | "compressed-tensors" | "compressed-tensors-int4" | "gptq" | "awq"
    scale_name: str = "weight_scale"  # FP8: the tensor beside each quantized weight
    block: tuple[int, int] | None = None  # fp8: (rows, cols) of one scale's block; None: per channel or tensor
    group_size: int = 0  # int4: inputs sharing one scale and zero point (compressed-tensors: 0 = per channel)
    symmetric: bool = True  # compressed-tensors int4: no zero points stored
    activations_dynamic: bool = False  # FP8: the checkpoint declares activations quantized per token at run time

    @property
    def int4(self) -> bool:
        return self.method in ("gptq", "awq", "compressed-tensors-int4")

    def parts(self) -> frozenset[str]:
        """The tensors that make up one quantized linear layer's weight."""
        if self.method == "compressed-tensors-int4":
            return frozenset({"weight_packed", "weight_scale", "weight_shape"} | (set() if self.symmetric else {"weight_zero_point"}))
        if self.method == "gptq":
            return frozenset({"qweight", "qzeros", "scales", "g_idx"})
        if self.method == "awq":
            return frozenset({"qweight", "qzeros", "scales"})
        return frozenset({"weight", self.scale_name})

    def is_part(self, leaf: str, tensor: torch.Tensor) -> bool:
        if self.int4:
            return leaf in self.parts()
        return leaf == self.scale_name or (leaf == "weight" and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))


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
        # transformers' FP8 config defaults to "dynamic"; "static" input scales are ignored (W8A16)
        dynamic = config.get("activation_scheme", "dynamic") == "dynamic"
        return WeightQuantization("fp8", "weight_scale_inv", (block[0], block[1]), activations_dynamic=dynamic)
    if method == "compressed-tensors":
        fmt = config.get("format")
        if fmt == "pack-quantized":
            return _compressed_int4(config)
        if fmt != "float-quantized":
            raise UnsupportedModelError(f"quantization_config.format {fmt!r} of compressed-tensors is not supported yet "
                                        "(supported: 'float-quantized', 'pack-quantized')")
        groups = config.get("config_groups") or {}
        for name, group in groups.items():
            weights = group.get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8 or weights.get("strategy") not in ("channel", "tensor"):
                raise UnsupportedModelError(f"quantization_config.config_groups.{name}.weights {weights!r}: supported are 8-bit "
                                            "float weights per channel or per tensor")
        dynamic = bool(groups) and all(_dynamic_fp8_activations(group.get("input_activations")) for group in groups.values())
        return WeightQuantization("compressed-tensors", "weight_scale", activations_dynamic=dynamic)
    if method in ("gptq", "awq"):
        bits = config.get("bits", config.get("w_bit"))
        group = config.get("group_size", config.get("q_group_size"))
        if bits != 4:
            raise UnsupportedModelError(f"quantization_config.bits {bits!r}: {method} is supported with 4-bit weights")
        if not isinstance(group, int) or group <= 0:
            raise UnsupportedModelError(f"quantization_config.group_size {group!r}: {method} needs a positive group size "
                                        "(per-channel -1 is not supported yet)")
        if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
            raise UnsupportedModelError(f"quantization_config.version {config.get('version')!r}: AWQ is supported in its GEMM packing")
        if method == "gptq" and config.get("checkpoint_format", "gptq") != "gptq":
            raise UnsupportedModelError(f"quantization_config.checkpoint_format {config.get('checkpoint_format')!r}: GPTQ is "
                                        "supported in the 'gptq' (v1) format")
        return WeightQuantization(method, group_size=group)
    raise UnsupportedModelError(f"quantization_config.quant_method {method!r} is not supported yet "
                                "(supported: 'fp8' with weight_block_size, 'compressed-tensors' float-quantized, 'gptq', 'awq')")


def _dynamic_fp8_activations(scheme: dict | None) -> bool:
    """Whether compressed-tensors' `input_activations` quantize to 8-bit floats at run time (FP8-Dynamic:
    per token; per tensor too, which per-token scales only refine). Static ones (`input_scale`
    tensors) are ignored: those checkpoints run W8A16."""
    return bool(scheme) and scheme.get("type") == "float" and scheme.get("num_bits") == 8 and scheme.get("dynamic") is True \
        and scheme.get("strategy") in ("token", "tensor")


def _compressed_int4(config: dict) -> WeightQuantization:
    """compressed-tensors' pack-quantized format: one scheme of 4-bit int weights, per group or channel."""
    groups = config.get("config_groups") or {}
    schemes = {_scheme_key(group.get("weights") or {}) for group in groups.values()}
    if len(schemes) != 1:
        raise UnsupportedModelError(f"quantization_config.config_groups: {len(schemes)} weight schemes; pack-quantized is "
                                    "supported with one")
    weights = next(iter(groups.values())).get("weights") or {}
    if weights.get("type") != "int" or weights.get("num_bits") != 4 or weights.get("strategy") not in ("group", "channel"):
        raise UnsupportedModelError(f"quantization_config.config_groups weights {weights!r}: pack-quantized is supported with "
                                    "4-bit int weights per group or channel")
    group = weights.get("group_size") if weights.get("strategy") == "group" else 0
    if group is not None and (not isinstance(group, int) or group < 0):
        raise UnsupportedModelError(f"quantization_config.config_groups weights.group_size {group!r}")
    return WeightQuantization("compressed-tensors-int4", group_size=group or 0, symmetric=bool(weights.get("symmetric", True)))


def _scheme_key(value: dict) -> str:
    return json.dumps(value, sort_keys=True)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, spec: WeightQuantization, name: str) -> torch.Tensor:
    """One FP8 weight [out, in] and its scale -> float32."""
    check_parts({"weight": weight, spec.scale_name: scale}, spec, name.removesuffix(".weight"))
    w = weight.float()
    if spec.block is None:
        return w * scale.float().reshape(-1, 1) if scale.numel() > 1 else w * scale.float().reshape(())
    rows, cols = spec.block
    full = scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: w.shape[0], : w.shape[1]]
    return w * full


# AWQ's GEMM packing puts the 8 nibbles of one int32 in this column order (AutoAWQ's order_map);
# unpacking reads nibble i and puts it back at column AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding 8 unsigned 4-bit values each (nibble i = bits 4i..4i+3) -> the values, the
    packed dimension 8 times longer (nibble i of word j at index 8j + i)."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [..., words, 8]
    if dim in (0, -packed.dim()):
        return nibbles.movedim(-1, 1).reshape(packed.shape[0] * 8, *packed.shape[1:])
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def dequantize_gptq(parts: dict[str, torch.Tensor], group_size: int, name: str) -> torch.Tensor:
    """GPTQ (v1 format): qweight [in / 8, out] packed along the input, qzeros [groups, out / 8] packed along
    the output and stored minus one, scales [groups, out], g_idx [in] (each input row's group, any order:
    act-order included) -> the linear weight [out, in] in float32."""
    check_parts(parts, WeightQuantization("gptq", group_size=group_size), name.removesuffix(".weight"))
    q = unpack_int4(parts["qweight"], 0)  # [in, out]
    zeros = unpack_int4(parts["qzeros"], 1)[:, : q.shape[1]] + 1  # [groups, out]
    groups = parts["g_idx"].long()
    return ((q - zeros[groups]).float() * parts["scales"].float()[groups]).t()


def pack_int4(values: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """8 unsigned 4-bit values per int32 along `dim` (nibble i holds element order[i] of each 8), as the
    formats store them (the top nibble wraps into the sign bit). The inverse of unpack_int4."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)]
    words = (v << torch.arange(0, 32, 4, device=v.device)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's GEMM packing along the output, unpacked into natural column order."""
    reverse = torch.tensor([AWQ_ORDER.index(i) for i in range(8)])
    values = unpack_int4(packed, 1).view(packed.shape[0], -1, 8)
    return values[:, :, reverse].reshape(packed.shape[0], -1)


def dequantize_awq(parts: dict[str, torch.Tensor], group_size: int, name: str) -> torch.Tensor:
    """AWQ (GEMM): qweight [in, out / 8] and qzeros [in / group, out / 8] packed along the output in AWQ's
    nibble order, scales [in / group, out] -> the linear weight [out, in] in float32."""
    check_parts(parts, WeightQuantization("awq", group_size=group_size), name.removesuffix(".weight"))
    q, zeros, scales = awq_columns(parts["qweight"]), awq_columns(parts["qzeros"]), parts["scales"].float()
    groups = torch.arange(q.shape[0]) // group_size
    return ((q - zeros[groups]).float() * scales[groups]).t()


def dequantize_compressed_int4(parts: dict[str, torch.Tensor], spec: WeightQuantization, name: str) -> torch.Tensor:
    """compressed-tensors pack-quantized: weight_packed [out, ceil(in / 8)] (nibble i of a word is input
    8j + i, stored + 8), weight_scale [out, groups], weight_shape [out, in], weight_zero_point
    [ceil(out / 8), groups] packed along the output (asymmetric only) -> the weight [out, in] in float32."""
    check_parts(parts, spec, name.removesuffix(".weight"))
    out_features, in_features = (int(v) for v in parts["weight_shape"].tolist())
    q = unpack_int4(parts["weight_packed"], 1)[:, :in_features] - 8
    scales = parts["weight_scale"].float()
    columns = torch.arange(in_features) // (spec.group_size or in_features)
    zeros = torch.zeros_like(scales)
    if not spec.symmetric:
        zeros = (unpack_int4(parts["weight_zero_point"], 0)[:out_features] - 8).float()
    return (q.float() - zeros[:, columns]) * scales[:, columns]


# The integer tensors of the int4 formats and their ranks; every other part is a float scale
_INT_PARTS = {"qweight": 2, "qzeros": 2, "g_idx": 1, "weight_packed": 2, "weight_zero_point": 2, "weight_shape": 1}


def check_parts(parts: dict[str, torch.Tensor], spec: WeightQuantization, owner: str,
                where: Callable[[str], str | None] = lambda name: None) -> None:
    """Checks one quantized weight's tensors (`owner`.qweight, ...) against the format and each other before
    anything reads them: dequantizing indexes with them and the kernels trust their shapes. A tensor of the
    wrong rank, dtype, shape or index range is a WeightsMismatchError naming it, what was expected, what
    was found, and the file `where` gives for it."""

    def refuse(leaf: str, expected: str, found: object) -> NoReturn:
        name = f"{owner}.{leaf}"
        raise WeightsMismatchError(f"tensor {name!r} ({spec.method}): expected {expected}, found {found}", where(name))

    def expect_shape(leaf: str, shape: tuple[int, ...], why: str) -> None:
        if tuple(parts[leaf].shape) != shape:
            refuse(leaf, f"shape {list(shape)} ({why})", f"shape {list(parts[leaf].shape)}")

    for leaf, tensor in parts.items():
        integer = leaf in _INT_PARTS
        if integer and (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool):
            refuse(leaf, "an integer tensor", tensor.dtype)
        if not integer and not tensor.dtype.is_floating_point:
            refuse(leaf, "a floating-point tensor", tensor.dtype)
        flexible = leaf == spec.scale_name and not spec.int4 and spec.block is None  # per channel or tensor: checked below
        rank = _INT_PARTS.get(leaf, 2)
        if tensor.dim() != rank and not flexible:
            refuse(leaf, f"{rank} dimension(s)", f"shape {list(tensor.shape)}")
    if spec.method == "gptq":
        inputs, outputs = parts["qweight"].shape[0] * 8, parts["qweight"].shape[1]
        groups = -(-inputs // spec.group_size)
        layout = f"qweight {list(parts['qweight'].shape)}: {inputs} inputs in groups of {spec.group_size}, {outputs} outputs"
        expect_shape("scales", (groups, outputs), layout)
        expect_shape("qzeros", (groups, -(-outputs // 8)), f"{layout}, 8 a word")
        expect_shape("g_idx", (inputs,), f"{layout}: one group per input")
        g_idx = parts["g_idx"]
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            refuse("g_idx", f"group indices in [0, {groups}) ({layout})", f"values from {int(g_idx.min())} to {int(g_idx.max())}")
    elif spec.method == "awq":
        inputs, words = parts["qweight"].shape
        groups = -(-inputs // spec.group_size)
        layout = f"qweight {[inputs, words]}: {inputs} inputs in groups of {spec.group_size}, {words * 8} outputs"
        expect_shape("qzeros", (groups, words), f"{layout}, 8 a word")
        expect_shape("scales", (groups, words * 8), layout)
    elif spec.method == "compressed-tensors-int4":
        shape = parts["weight_shape"]
        if shape.numel() != 2 or int(shape.min()) <= 0:
            refuse("weight_shape", "[out_features, in_features] (two positive ints)", shape.tolist())
        outputs, inputs = (int(v) for v in shape.tolist())
        group = spec.group_size or inputs
        groups = -(-inputs // group)
        layout = f"weight_shape {[outputs, inputs]}"
        expect_shape("weight_packed", (outputs, -(-inputs // 8)), f"{layout}, 8 inputs a word")
        expect_shape("weight_scale", (outputs, groups), f"{layout}, inputs in groups of {group}")
        if not spec.symmetric:
            expect_shape("weight_zero_point", (-(-outputs // 8), groups), f"{layout}, inputs in groups of {group}, 8 outputs a word")
    else:
        weight, scale = parts["weight"], parts[spec.scale_name]
        if spec.block is not None:
            rows, cols = spec.block
            expected = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
            expect_shape(spec.scale_name, expected, f"one per {rows}x{cols} block of the weight {list(weight.shape)}")
        elif scale.dim() > 2 or tuple(scale.squeeze().shape) not in ((), (weight.shape[0],)):
            refuse(spec.scale_name, f"one scale per output channel ([{weight.shape[0]}, 1]) or one for the tensor ([1])",
                   f"shape {list(scale.shape)} for the weight {list(weight.shape)}")


def _dequantize(parts: dict[str, torch.Tensor], spec: WeightQuantization, name: str) -> torch.Tensor:
    if spec.method == "compressed-tensors-int4":
        return dequantize_compressed_int4(parts, spec, name)
    if spec.method == "gptq":
        return dequantize_gptq(parts, spec.group_size, name)
    if spec.method == "awq":
        return dequantize_awq(parts, spec.group_size, name)
    return dequantize_fp8(parts["weight"], parts[spec.scale_name], spec, name)


@dataclass
class PackedInt4:
    """One int4 linear weight as the W4A16 GEMM reads it: qweight [in / 8, out] (nibble i of word r is
    input 8r + i, 0..15), scales and zeros [groups, out] (float32 here), and for GPTQ's act-order each
    input's group (g_idx [in] int32; None: input // group_size)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    g_idx: torch.Tensor | None = None


@dataclass
class PackedFp8:
    """One FP8 linear weight as the FP8 GEMM reads it: weight e4m3 [out, in], scales fp32
    [out, ceil(in / group_k)] (a block's scale repeated over its rows; per channel: group_k = in), and
    whether the checkpoint lets its activations be quantized per token (W8A8: layers/fp8_dispatch.py)."""

    weight: torch.Tensor
    scales: torch.Tensor
    group_k: int
    activations_dynamic: bool = False


def fp8_for_kernel(weight: torch.Tensor, scale: torch.Tensor, spec: WeightQuantization) -> PackedFp8 | None:
    """The FP8 GEMM's layout of one e4m3 weight and its scale (checked by check_parts first)."""
    if weight.dtype != torch.float8_e4m3fn:
        return None
    rows, cols = weight.shape
    if spec.block is None:
        return PackedFp8(weight, scale.float().reshape(-1, 1).expand(rows, 1).contiguous(), cols, spec.activations_dynamic)
    block_rows, block_cols = spec.block
    return PackedFp8(weight, scale.float().repeat_interleave(block_rows, 0)[:rows].contiguous(), block_cols,
                     spec.activations_dynamic)


def pack_for_kernel(parts: dict[str, torch.Tensor], spec: WeightQuantization) -> PackedInt4 | PackedFp8 | None:
    """The kernel's layout of one quantized weight, or None where it has none (an int4 group size that is
    not a multiple of 8; compressed-tensors int4 over inputs that are not a multiple of 8)."""
    if not spec.int4:
        return fp8_for_kernel(parts["weight"], parts[spec.scale_name], spec)
    if spec.method == "compressed-tensors-int4":
        return _compressed_int4_for_kernel(parts, spec)
    if spec.group_size % 8:
        return None
    if spec.method == "gptq":
        rows = parts["qweight"].shape[0] * 8
        in_order = torch.equal(parts["g_idx"].long(), torch.arange(rows) // spec.group_size)
        zeros = unpack_int4(parts["qzeros"], 1)[:, : parts["qweight"].shape[1]] + 1
        return PackedInt4(parts["qweight"].to(torch.int32), parts["scales"].float(), zeros.float(),
                          spec.group_size, None if in_order else parts["g_idx"].to(torch.int32))
    if spec.method == "awq":
        return PackedInt4(pack_int4(awq_columns(parts["qweight"]), 0), parts["scales"].float(),
                          awq_columns(parts["qzeros"]).float(), spec.group_size)
    return None


def _compressed_int4_for_kernel(parts: dict[str, torch.Tensor], spec: WeightQuantization) -> PackedInt4 | None:
    """compressed-tensors pack-quantized is GPTQ's packing along the inputs, transposed, with the values
    stored + 8: qweight is weight_packed^T, the zeros 8 (or the zero points + 8)."""
    out_features, in_features = (int(v) for v in parts["weight_shape"].tolist())
    group = spec.group_size or in_features
    if in_features % 8 or group % 8:
        return None
    scales = parts["weight_scale"].float().t().contiguous()  # [groups, out]
    zeros = torch.full_like(scales, 8.0)
    if not spec.symmetric:
        zeros += unpack_int4(parts["weight_zero_point"], 0)[:out_features].float().t() - 8
    return PackedInt4(parts["weight_packed"].to(torch.int32).t().contiguous(), scales, zeros, group)


def dense_shape(layout: PackedInt4 | PackedFp8) -> tuple[int, int]:
    """The [out, in] of the linear weight a kernel layout holds."""
    if isinstance(layout, PackedFp8):
        return tuple(layout.weight.shape)
    return layout.qweight.shape[1], layout.qweight.shape[0] * 8


def dequantize_packed(layout: PackedInt4 | PackedFp8) -> torch.Tensor:
    """A kernel layout's weight [out, in] in float32 (where a layer cannot run the quantized GEMM after all)."""
    if isinstance(layout, PackedFp8):
        columns = torch.arange(layout.weight.shape[1], device=layout.weight.device) // layout.group_k
        return layout.weight.float() * layout.scales[:, columns]
    q = unpack_int4(layout.qweight, 0).float()  # [in, out]
    groups = layout.g_idx.long() if layout.g_idx is not None else torch.arange(q.shape[0], device=q.device) // layout.group_size
    return ((q - layout.zeros[groups]) * layout.scales[groups]).t()


def dequantize_tensors(weights: Iterable[tuple[str, torch.Tensor]], spec: WeightQuantization,
                       packed: dict[str, PackedInt4 | PackedFp8] | None = None,
                       keep_packed: Callable[[str], bool] = lambda owner: False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized linear weight (FP8 `X.weight` with its scale; GPTQ's or
    AWQ's `X.qweight`, `X.qzeros`, `X.scales`, `X.g_idx`) dequantized to float32 as `X.weight` once all its
    parts are read; every other tensor passes through. With `packed`, each weight's kernel layout is kept
    there, and where `keep_packed(owner)` says the model will not hold the dense weight, `X.weight` comes
    as a meta tensor of its shape (nothing dequantized, nothing allocated). A part left without the others,
    or one of the wrong shape, dtype or range (check_parts), is a WeightsMismatchError naming it and its file."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = spec.parts()
    where: Callable[..., str | None] = getattr(weights, "where", lambda name=None: None)  # loader.CheckpointTensors: the file
    for name, tensor in weights:
        owner, _, leaf = name.rpartition(".")
        if leaf in IGNORED_SUFFIXES:
            continue
        if not spec.is_part(leaf, tensor):
            if leaf in SCALE_SUFFIXES:
                raise WeightsMismatchError(f"tensor {name!r}: a {spec.method} checkpoint stores its scales as {spec.scale_name!r}",
                                           where(name))
            yield name, tensor
            continue
        group = pending.setdefault(owner, {})
        group[leaf] = tensor
        if needed <= group.keys():
            del pending[owner]
            check_parts(group, spec, owner, where)
            kernel_layout = pack_for_kernel(group, spec) if packed is not None else None
            if kernel_layout is not None:  # kept for the quantized GEMMs (layers/quantized_linear.py)
                packed[owner] = kernel_layout
                if keep_packed(owner):
                    yield f"{owner}.weight", torch.empty(dense_shape(kernel_layout), device="meta")
                    continue
            yield f"{owner}.weight", _dequantize(group, spec, f"{owner}.weight")
    if pending:
        lost = [f"{owner} ({', '.join(sorted(needed - group.keys()))} missing)" for owner, group in pending.items()]
        raise WeightsMismatchError(f"incomplete quantized weights: {', '.join(lost[:8])}", where())
