"""A preprocessing worker's output tensors, in one shared-memory segment it keeps (preprocess_pool.py).

A new shared segment per picture costs more than preparing the picture: the kernel makes the segment and
zeroes every page of it as it is first touched (a 1920x1080 photo at Qwen2.5-VL's max_pixels is 23 MB of
float32 patches: ~45 ms, where the fast path's own work is ~45 ms), and the engine maps it anew to copy it
out. So a worker makes one segment, grown when a picture needs more, and lays each picture's tensors in it
from its start: the engine copies a reply's tensors out on arrival, before it sends that worker its next
picture, so the next picture may write over them. The segment crosses to the engine once (a file
descriptor, as torch shares tensors), when it is new; a reply names where each tensor lies (`Placed`).
A tensor that does not fit (the first picture larger than any before) is a segment of its own, sent as
before, and the segment grows to fit the next such picture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mmengine.errors import PreprocessingWorkerError
from mmengine.models.family import EncoderInputs

ALIGN = 64  # bytes: every tensor starts on a cache line (and so on its dtype's size)


@dataclass(frozen=True)
class Placed:
    """Where one output tensor lies in its worker's segment (plain data, pickled with the reply)."""

    offset: int  # bytes from the segment's start
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# A reply's tensors: each placed in the segment, or (one that did not fit) a shared tensor of its own
Layout = dict[str, "Placed | torch.Tensor"]


def shared_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in a shared-memory segment of its own."""
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class OutputArena:
    """The worker's side: `start()` before each picture, `allocate` for the fast path's outputs, `layout()` for
    the reply, and `take_new_segment()`: the segment to send with it, when the engine does not have it yet."""

    def __init__(self) -> None:
        self.segment: torch.Tensor | None = None  # uint8, in shared memory
        self._used = 0  # bytes this picture's tensors take (laid out as if the segment held them all)
        self._wanted = 0  # the largest such need so far: the segment grows to it before the next picture
        self._unsent = False

    @property
    def capacity(self) -> int:
        return 0 if self.segment is None else self.segment.numel()

    def start(self) -> None:
        """A new picture's tensors go from the segment's start (grown first, if the last picture overflowed it)."""
        if self._wanted > self.capacity:
            self.segment = shared_tensor((self._wanted,), torch.uint8)
            self._unsent = True
        self._used = 0

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
        """An output tensor (the fast path's Allocate): in the segment, or in one of its own if it does not fit."""
        return self._place(tuple(shape), torch.from_numpy(np.empty(0, dtype=dtype)).dtype)

    def _place(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        offset = -(-self._used // ALIGN) * ALIGN
        end = offset + math.prod(shape) * dtype.itemsize
        self._used = end
        self._wanted = max(self._wanted, end)
        if end > self.capacity:
            return shared_tensor(shape, dtype)
        return self.segment[offset:end].view(dtype).view(shape)

    def layout(self, inputs: EncoderInputs) -> Layout:
        """Where the picture's tensors lie. One made in this process's memory (by transformers' processor, a
        family's own split) is copied into the segment if it fits, else into a shared tensor of its own."""
        placed: Layout = {}
        for name, tensor in inputs.items():
            offset = self._offset_of(tensor)
            if offset is None and not tensor.is_shared():
                target = self._place(tuple(tensor.shape), tensor.dtype)
                target.copy_(tensor)
                tensor, offset = target, self._offset_of(target)
            placed[name] = Placed(offset, tuple(tensor.shape), tensor.dtype) if offset is not None else tensor
        return placed

    def take_new_segment(self) -> torch.Tensor | None:
        if not self._unsent:
            return None
        self._unsent = False
        return self.segment

    def _offset_of(self, tensor: torch.Tensor) -> int | None:
        """The tensor's offset in the segment, if it lies there whole and contiguous."""
        if self.segment is None or not tensor.is_contiguous():
            return None
        if tensor.untyped_storage().data_ptr() != self.segment.untyped_storage().data_ptr():
            return None
        return tensor.data_ptr() - self.segment.data_ptr()


def copy_out(layout: Layout, segment: torch.Tensor | None) -> EncoderInputs:
    """The engine's side: the reply's tensors in this process's own memory (the worker may write over the
    segment once it has its next picture; a tensor of its own lets its segment go with it)."""
    inputs = {}
    for name, where in layout.items():
        if isinstance(where, Placed):
            if segment is None:
                raise PreprocessingWorkerError(f"a preprocessing worker placed {name!r} in a segment it never sent")
            where = segment[where.offset:where.offset + where.nbytes].view(where.dtype).view(where.shape)
        inputs[name] = where.clone()
    return EncoderInputs(inputs)
