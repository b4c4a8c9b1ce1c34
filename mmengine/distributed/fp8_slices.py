"""FP8 checkpoint weights read by slice at tensor parallelism: a rank reads only its rows (a column-parallel
layer) or columns (a row-parallel one) of each e4m3 weight, with the scales of the blocks (or channels) those
cover, and dequantizes just that part. So no rank reads a whole quantized weight: on an FP8 checkpoint of a
model split N ways each rank reads 1/N of it, as on a bf16 one.

The scales are small (one per 128 x 128 block, or per output channel) and read whole; the weight stays a
safetensors slice, reopened from its file when a layer's weight loader asks for its part (a weight and its
scale may sit in different files of a sharded checkpoint, which CheckpointSlices opens one at a time). The
values equal dequantizing the whole weight and then slicing it: each element is its e4m3 value times its
block's scale either way. Int4 formats (GPTQ, AWQ, compressed-tensors pack-quantized) are still read whole and
dequantized (distributed/sharded_model.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from mmengine.distributed.checkpoint_slices import CheckpointSlice, CheckpointSlices
from mmengine.errors import WeightsMismatchError
from mmengine.models.quantization import IGNORED_SUFFIXES, SCALE_SUFFIXES, WeightQuantization, check_parts

_FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class Fp8WeightSlice:
    """One FP8 weight [out, in] as a lazy slice of its dequantized float32 values (TensorSlice: `get_shape()`,
    and indexing with `[...]`, `[rows]` or `[:, columns]`, the forms a weight loader reads with)."""

    def __init__(self, path: Path, name: str, shape: torch.Size, scale: torch.Tensor, spec: WeightQuantization) -> None:
        self.path, self.name, self.shape = path, name, shape
        self.scale = scale.float()
        self.spec = spec

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        (r0, r1), (c0, c1) = _ranges(index, self.shape, self.name)
        with safe_open(str(self.path), framework="pt", device="cpu") as f:
            weight = f.get_slice(self.name)[r0:r1, c0:c1]
        return weight.float() * self._scales(r0, r1, c0, c1)

    def _scales(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """The scale of every element of weight[r0:r1, c0:c1], or one broadcasting to it."""
        scale = self.scale
        if self.spec.block is None:  # one for the tensor, or one an output channel
            return scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)[r0:r1]
        rows, cols = self.spec.block
        first_row, first_col = r0 // rows, c0 // cols
        blocks = scale[first_row : -(-r1 // rows), first_col : -(-c1 // cols)]
        full = blocks.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return full[r0 - first_row * rows : r1 - first_row * rows, c0 - first_col * cols : c1 - first_col * cols]


def _ranges(index: object, shape: torch.Size, name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(rows, columns) ranges of a contiguous 2-D index: `...`, a slice of rows, or all rows and a slice of columns."""
    if index is Ellipsis:
        index = ()
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > 2 or not all(isinstance(p, slice) and p.step in (None, 1) for p in parts):
        raise TypeError(f"{name}: an FP8 weight slice reads contiguous rows or columns, not {index!r}")
    ranges = [part.indices(size)[:2] for part, size in zip(parts, shape)]
    ranges += [(0, size) for size in shape[len(ranges):]]
    return ranges[0], ranges[1]


def fp8_weight_slices(slices: CheckpointSlices, spec: WeightQuantization,
                      skip: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors as slices, each FP8 weight with its scale as one `X.weight` Fp8WeightSlice (checked
    as models/quantization.py's check_parts checks them, from the header's shape and dtype); the names `skip`
    picks (another rank's experts) are never read. A weight or scale left without the other is named."""
    pending: dict[str, dict[str, object]] = {}
    needed = spec.parts()
    for name, tensor in slices:
        if skip(name):
            continue
        owner, _, leaf = name.rpartition(".")
        if leaf in IGNORED_SUFFIXES:
            continue
        dtype = _FP8_DTYPES.get(tensor.raw.get_dtype()) if leaf == "weight" else None
        if leaf != spec.scale_name and dtype is None:
            if leaf in SCALE_SUFFIXES:
                raise WeightsMismatchError(f"tensor {name!r}: a {spec.method} checkpoint stores its scales as {spec.scale_name!r}",
                                           slices.where(name))
            yield name, tensor
            continue
        group = pending.setdefault(owner, {})
        group[leaf] = (tensor, dtype) if leaf == "weight" else tensor[...]
        if needed <= group.keys():
            del pending[owner]
            yield f"{owner}.weight", _checked(owner, group, spec, slices)
    if pending:
        lost = [f"{owner} ({', '.join(sorted(needed - group.keys()))} missing)" for owner, group in pending.items()]
        raise WeightsMismatchError(f"incomplete quantized weights: {', '.join(lost[:8])}", slices.where())


def _checked(owner: str, group: dict[str, object], spec: WeightQuantization, slices: CheckpointSlices) -> Fp8WeightSlice:
    weight, dtype = group["weight"]
    assert isinstance(weight, CheckpointSlice)
    scale = group[spec.scale_name]
    # the weight's shape and dtype from the header (a meta tensor: nothing read)
    check_parts({"weight": torch.empty(weight.shape, dtype=dtype, device="meta"), spec.scale_name: scale}, spec, owner, slices.where)
    name = f"{owner}.weight"
    return Fp8WeightSlice(Path(slices.where(name)), name, weight.shape, scale, spec)
