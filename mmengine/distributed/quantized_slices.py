"""Quantized checkpoint weights read by slice at tensor parallelism: a rank reads only the part of each
quantized weight its rows (a column-parallel layer) or columns (a row-parallel one) need, and dequantizes just
that part. So no rank reads a whole quantized weight: on an FP8 or int4 checkpoint of a model split N ways each
rank reads about 1/N of it, as on a bf16 one.

What is sliced is the big tensor of each weight: FP8's e4m3 `weight`, GPTQ's and AWQ's `qweight`,
compressed-tensors' `weight_packed` (int4 words are read whole where a slice cuts one: 8 values a word). The
scales, zero points and GPTQ's `g_idx` are small (one per block, group or input) and read whole. The big tensor
stays a safetensors slice, reopened from its file when a layer's weight loader asks for its part (a weight and
its scales may sit in different files of a sharded checkpoint, which CheckpointSlices opens one at a time). The
values equal dequantizing the whole weight and then slicing it: each element's arithmetic is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from mmengine.distributed.checkpoint_slices import CheckpointSlice, CheckpointSlices
from mmengine.errors import WeightsMismatchError
from mmengine.models.quantization import (
    IGNORED_SUFFIXES,
    SCALE_SUFFIXES,
    WeightQuantization,
    awq_columns,
    check_parts,
    unpack_int4,
)

_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I32": torch.int32, "I64": torch.int64,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
_BIG_PART = {"gptq": "qweight", "awq": "qweight", "compressed-tensors-int4": "weight_packed"}  # FP8: "weight"


def big_part(spec: WeightQuantization) -> str:
    return _BIG_PART.get(spec.method, "weight")


class QuantizedWeightSlice:
    """One quantized weight as a lazy slice of its dequantized float32 values [out, in] (TensorSlice: `get_shape()`,
    and indexing with `[...]`, `[rows]` or `[:, columns]`, the forms a weight loader reads with). `parts` holds
    the small tensors, read; the big one is read from `path` by window."""

    def __init__(self, path: Path, name: str, shape: tuple[int, int], parts: dict[str, torch.Tensor], spec: WeightQuantization) -> None:
        self.path, self.name, self.shape = path, name, torch.Size(shape)
        self.parts, self.spec = parts, spec

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        (r0, r1), (c0, c1) = _ranges(index, self.shape, self.name)
        method = self.spec.method
        if method == "gptq":
            return self._gptq(r0, r1, c0, c1)
        if method == "awq":
            return self._awq(r0, r1, c0, c1)
        if method == "compressed-tensors-int4":
            return self._compressed_int4(r0, r1, c0, c1)
        return self._read(slice(r0, r1), slice(c0, c1)).float() * self._fp8_scales(r0, r1, c0, c1)

    def _read(self, rows: slice, cols: slice) -> torch.Tensor:
        with safe_open(str(self.path), framework="pt", device="cpu") as f:
            return f.get_slice(self.name)[rows, cols]

    def _fp8_scales(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """The scale of every element of weight[r0:r1, c0:c1], or one broadcasting to it."""
        scale = self.parts[self.spec.scale_name].float()
        if self.spec.block is None:  # one for the tensor, or one an output channel
            return scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)[r0:r1]
        rows, cols = self.spec.block
        first_row, first_col = r0 // rows, c0 // cols
        blocks = scale[first_row : -(-r1 // rows), first_col : -(-c1 // cols)]
        full = blocks.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return full[r0 - first_row * rows : r1 - first_row * rows, c0 - first_col * cols : c1 - first_col * cols]

    def _gptq(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """qweight [in / 8, out] packed along the input: the words holding inputs c0..c1, outputs r0..r1."""
        first = c0 // 8
        q = unpack_int4(self._read(slice(first, -(-c1 // 8)), slice(r0, r1)), 0)[c0 - first * 8 : c1 - first * 8]
        zeros = unpack_int4(self.parts["qzeros"], 1)[:, r0:r1] + 1
        groups = self.parts["g_idx"][c0:c1].long()
        return ((q - zeros[groups]).float() * self.parts["scales"].float()[:, r0:r1][groups]).t()

    def _awq(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """qweight [in, out / 8] packed along the output in AWQ's order: inputs c0..c1, the words holding r0..r1."""
        first = r0 // 8
        q = awq_columns(self._read(slice(c0, c1), slice(first, -(-r1 // 8))))[:, r0 - first * 8 : r1 - first * 8]
        zeros = awq_columns(self.parts["qzeros"])[:, r0:r1]
        groups = torch.arange(c0, c1) // self.spec.group_size
        return ((q - zeros[groups]).float() * self.parts["scales"].float()[:, r0:r1][groups]).t()

    def _compressed_int4(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """weight_packed [out, in / 8] packed along the input (stored + 8): outputs r0..r1, the words of c0..c1."""
        first = c0 // 8
        q = unpack_int4(self._read(slice(r0, r1), slice(first, -(-c1 // 8))), 1)[:, c0 - first * 8 : c1 - first * 8] - 8
        scales = self.parts["weight_scale"].float()[r0:r1]
        columns = torch.arange(c0, c1) // (self.spec.group_size or self.shape[1])
        zeros = torch.zeros_like(scales)
        if not self.spec.symmetric:
            zeros = (unpack_int4(self.parts["weight_zero_point"], 0)[: self.shape[0]] - 8).float()[r0:r1]
        return (q.float() - zeros[:, columns]) * scales[:, columns]


def _ranges(index: object, shape: torch.Size, name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(rows, columns) ranges of a contiguous 2-D index: `...`, a slice of rows, or all rows and a slice of columns."""
    if index is Ellipsis:
        index = ()
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > 2 or not all(isinstance(p, slice) and p.step in (None, 1) for p in parts):
        raise TypeError(f"{name}: a quantized weight slice reads contiguous rows or columns, not {index!r}")
    ranges = [part.indices(size)[:2] for part, size in zip(parts, shape)]
    ranges += [(0, size) for size in shape[len(ranges):]]
    return ranges[0], ranges[1]


def quantized_weight_slices(slices: CheckpointSlices, spec: WeightQuantization,
                            skip: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors as slices, each quantized weight with its scales (and zeros) as one `X.weight`
    QuantizedWeightSlice, checked as models/quantization.py's check_parts checks them (the big tensor from the
    header's shape and dtype); the names `skip` picks (another rank's experts) are never read. A part left
    without the others is named."""
    pending: dict[str, dict[str, object]] = {}
    needed, big = spec.parts(), big_part(spec)
    for name, tensor in slices:
        if skip(name):
            continue
        owner, _, leaf = name.rpartition(".")
        if leaf in IGNORED_SUFFIXES:
            continue
        dtype = _DTYPES.get(tensor.raw.get_dtype()) if leaf == big else None
        fp8_weight = leaf == big and dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if not (leaf in needed and (spec.int4 or leaf != "weight" or fp8_weight)):
            if leaf in SCALE_SUFFIXES:
                raise WeightsMismatchError(f"tensor {name!r}: a {spec.method} checkpoint stores its scales as {spec.scale_name!r}",
                                           slices.where(name))
            yield name, tensor
            continue
        group = pending.setdefault(owner, {})
        group[leaf] = (tensor, dtype) if leaf == big else tensor[...]
        if needed <= group.keys():
            del pending[owner]
            yield f"{owner}.weight", _checked(owner, group, spec, slices)
    if pending:
        lost = [f"{owner} ({', '.join(sorted(needed - group.keys()))} missing)" for owner, group in pending.items()]
        raise WeightsMismatchError(f"incomplete quantized weights: {', '.join(lost[:8])}", slices.where())


def _checked(owner: str, group: dict[str, object], spec: WeightQuantization, slices: CheckpointSlices) -> QuantizedWeightSlice:
    big = big_part(spec)
    weight, dtype = group.pop(big)
    assert isinstance(weight, CheckpointSlice)
    if dtype is None:
        raise WeightsMismatchError(f"tensor {owner}.{big!r} ({spec.method}): expected an integer or FP8 tensor, found "
                                   f"{weight.raw.get_dtype()}", slices.where(f"{owner}.{big}"))
    # the big tensor's shape and dtype from the header (a meta tensor: nothing read)
    check_parts({big: torch.empty(weight.shape, dtype=dtype, device="meta"), **group}, spec, owner, slices.where)
    rows, cols = weight.shape
    if spec.method == "gptq":
        shape = (cols, rows * 8)
    elif spec.method == "awq":
        shape = (cols * 8, rows)
    elif spec.method == "compressed-tensors-int4":
        shape = tuple(int(v) for v in group["weight_shape"].tolist())
    else:
        shape = (rows, cols)
    name = f"{owner}.{big}"
    return QuantizedWeightSlice(Path(slices.where(name)), name, shape, group, spec)
