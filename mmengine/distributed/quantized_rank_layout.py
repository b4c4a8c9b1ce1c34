"""One rank's part of a quantized weight in the quantized GEMMs' layout (models/quantization.py's PackedFp8 and
PackedInt4), read from the checkpoint by slice: the packed bits of the rank's rows (a column-parallel layer: its
outputs) or columns (a row-parallel one: its inputs), with the scales, zeros and g_idx that go with them. Nothing
is dequantized: the values are the checkpoint's, as TP 1's `pack_for_kernel` lays them out.

Cutting the outputs never cuts a scale: the kernels' layouts hold one scale row per output (an FP8 block's scale
repeated over its rows, int4 outputs unpacked). Cutting the inputs can: a rank whose inputs start inside an FP8
block or an int4 group keeps its scales at a finer grain, g = gcd(block or group, inputs per rank), each of its
groups of g inputs taking the scale of the block (group) it lies in; the same values, more scale rows. Qwen3's
MoE intermediate of 768 at TP 8 (96 inputs a rank, 128-wide blocks) keeps scales per 32 inputs. Where g is not a
multiple of 8 (an int4 word is 8 inputs, and scales per fewer inputs would outweigh FP8 weights), the layer
cannot stay quantized: `SliceCutsGroup` names it and start-up refuses. GPTQ's act-order (each input's group
from g_idx) needs no alignment: the rank keeps the groups its inputs use and its slice of g_idx, renumbered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from safetensors import safe_open

from mmengine.distributed.quantized_slices import QuantizedWeightSlice
from mmengine.errors import ConfigError
from mmengine.models.quantization import PackedFp8, PackedInt4, awq_columns, pack_int4, unpack_int4

WORD = 8  # int4 inputs per packed word; also the finest scale grain a rank keeps


@dataclass(frozen=True)
class RankSlice:
    """The rank's rows [r0, r1) (outputs) and columns [c0, c1) (inputs) of a weight [out, in], and for the error
    message the layer's name and the tensor-parallel size."""

    r0: int
    r1: int
    c0: int
    c1: int
    layer: str
    tp_size: int


def rank_layout(weight: QuantizedWeightSlice, part: RankSlice) -> PackedFp8 | PackedInt4 | None:
    """The kernel layout of `part` of `weight`, or None where TP 1 would not keep the weight quantized either
    (pack_for_kernel's None: an int4 group that is not a multiple of 8, an FP8 weight that is not e4m3).
    A ConfigError where the inputs' cut leaves groups of fewer than 8 inputs."""
    spec = weight.spec
    if not spec.int4:
        return _fp8(weight, part)
    if spec.method == "compressed-tensors-int4":
        group = spec.group_size or weight.shape[1]
        if weight.shape[1] % WORD or group % WORD:
            return None
    elif spec.group_size % WORD:
        return None
    if part.c0 % WORD or part.c1 % WORD:
        _refuse(part, "an int4 packing word", WORD, math.gcd(WORD, part.c0, part.c1))
    return _int4(weight, part)


def _read(weight: QuantizedWeightSlice, rows: slice, cols: slice) -> torch.Tensor:
    with safe_open(str(weight.path), framework="pt", device="cpu") as f:
        return f.get_slice(weight.name)[rows, cols]


def _fp8(weight: QuantizedWeightSlice, part: RankSlice) -> PackedFp8 | None:
    values = _read(weight, slice(part.r0, part.r1), slice(part.c0, part.c1))
    if values.dtype != torch.float8_e4m3fn:
        return None
    spec = weight.spec
    scale = weight.parts[spec.scale_name].float()
    rows, inputs = part.r1 - part.r0, part.c1 - part.c0
    if spec.block is None:  # per channel or per tensor: one group of all the rank's inputs
        per_row = scale.reshape(-1, 1)[part.r0 : part.r1] if scale.numel() > 1 else scale.reshape(1, 1).expand(rows, 1)
        return PackedFp8(values, per_row.contiguous(), inputs, spec.activations_dynamic)
    block_rows, block_cols = spec.block
    per_row = scale.repeat_interleave(block_rows, 0)[part.r0 : part.r1]  # [rows, input blocks]
    if (part.c0, part.c1) == (0, weight.shape[1]):  # the inputs whole: TP 1's layout
        return PackedFp8(values, per_row.contiguous(), block_cols, spec.activations_dynamic)
    group, columns = _regroup(block_cols, part, "an FP8 block")
    return PackedFp8(values, per_row[:, columns].contiguous(), group, spec.activations_dynamic)


def _regroup(group: int, part: RankSlice, what: str) -> tuple[int, torch.Tensor]:
    """The rank's grain g and, for each of its groups of g inputs, the checkpoint's group it lies in."""
    inputs = part.c1 - part.c0
    # every rank of an even split gets gcd(group, inputs per rank): its c0 is a multiple of it
    fine = math.gcd(group, part.c0, inputs)
    if fine % WORD:
        _refuse(part, what, group, fine)
    return fine, (part.c0 + torch.arange(-(-inputs // fine)) * fine) // group


def _refuse(part: RankSlice, what: str, group: int, fine: int) -> None:
    raise SliceCutsGroup(
        f"{part.layer}: input size {part.c1 - part.c0} per rank (tensor_parallel_size={part.tp_size}, inputs "
        f"{part.c0}..{part.c1}) cuts {what} of {group} inputs into pieces of {fine}, not a multiple of {WORD}: its "
        f"quantized weights cannot be kept split so; use a tensor_parallel_size for which gcd({group}, inputs per rank) "
        f"is a multiple of {WORD}, or attn_backend='torch' (which dequantizes at load)")


class SliceCutsGroup(ConfigError):
    """A rank's input slice that a quantized layer cannot keep (see the module's docstring)."""


def _int4(weight: QuantizedWeightSlice, part: RankSlice) -> PackedInt4:
    """GPTQ's packing along the inputs ([in / 8, out] int32), scales and zeros [groups, out] for the rank's part."""
    spec, parts, (r0, r1, c0, c1) = weight.spec, weight.parts, (part.r0, part.r1, part.c0, part.c1)
    g_idx = None
    if spec.method == "gptq":
        qweight = _read(weight, slice(c0 // WORD, c1 // WORD), slice(r0, r1))
        scales = parts["scales"].float()[:, r0:r1]
        zeros = (unpack_int4(parts["qzeros"], 1)[:, r0:r1] + 1).float()
        group = spec.group_size
        in_order = torch.equal(parts["g_idx"].long(), torch.arange(weight.shape[1]) // group)
        g_idx = None if in_order else parts["g_idx"].long()
    elif spec.method == "awq":
        first = r0 // WORD
        values = awq_columns(_read(weight, slice(c0, c1), slice(first, -(-r1 // WORD))))[:, r0 - first * WORD : r1 - first * WORD]
        qweight = pack_int4(values, 0)
        scales = parts["scales"].float()[:, r0:r1]
        zeros = awq_columns(parts["qzeros"])[:, r0:r1].float()
        group = spec.group_size
    else:  # compressed-tensors: weight_packed [out, in / 8] stored + 8
        qweight = _read(weight, slice(r0, r1), slice(c0 // WORD, c1 // WORD)).t()
        scales = parts["weight_scale"].float()[r0:r1].t()
        zeros = torch.full_like(scales, 8.0)
        if not spec.symmetric:
            zeros += unpack_int4(parts["weight_zero_point"], 0)[: weight.shape[0]][r0:r1].float().t() - 8
        group = spec.group_size or weight.shape[1]
    qweight = qweight.to(torch.int32).contiguous()
    if g_idx is not None:  # act-order: the groups the rank's inputs use, renumbered
        local = g_idx[c0:c1]
        used = torch.unique(local)
        inputs = c1 - c0
        grain = max(1, inputs // len(used))  # only the shape check reads it: ceil(inputs / grain) >= len(used) rows
        rows = -(-inputs // grain)
        pad = rows - len(used)
        return PackedInt4(qweight, _pad(scales[used], pad), _pad(zeros[used], pad), grain,
                          torch.searchsorted(used, local).to(torch.int32))
    if (c0, c1) == (0, weight.shape[1]):
        return PackedInt4(qweight, scales.contiguous(), zeros.contiguous(), group)
    fine, groups = _regroup(group, part, "an int4 group")
    return PackedInt4(qweight, scales[groups].contiguous(), zeros[groups].contiguous(), fine)


def _pad(rows: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([rows, rows.new_zeros(extra, rows.shape[1])]).contiguous() if extra else rows.contiguous()
