"""Pictures to the tensor-parallel ranks in shared memory, not pickled into the plan (DESIGN: what crosses a process
boundary is plain data and shared-memory tensors).

The driver writes a plan's new items' encoder inputs into one shared segment and the plan carries `SharedTensor`
handles (segment name, offset, shape, dtype); each rank copies them out when it takes the plan, before its first
collective, so once rank 0 has replied every rank has its copy and the driver unlinks the segment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from mmengine.core.request import MMItem

# Smaller tensors ride in the plan (a segment costs a file and two mappings)
MIN_SHARED_BYTES = 1 << 16


@dataclass(frozen=True)
class SharedTensor:
    segment: str
    offset: int
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"


class PlanSegment:
    """The driver's side: one segment for one plan's pictures."""

    def __init__(self, items: list[MMItem]) -> None:
        tensors = [t for item in items for t in item.encoder_inputs.values()
                   if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() * t.element_size() >= MIN_SHARED_BYTES]
        self.size = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)  # 64-byte aligned
        self.memory = shared_memory.SharedMemory(create=True, size=self.size) if self.size else None
        self.used = 0  # bytes handed out to the requests shared so far

    def share(self, items: list[MMItem]) -> list[MMItem]:
        """Copies of `items` whose large tensors are handles into this segment (the driver's items are not touched)."""
        if self.memory is None:
            return items
        shared, at = [], self.used
        for item in items:
            inputs = {}
            for name, tensor in item.encoder_inputs.items():
                nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
                if nbytes < MIN_SHARED_BYTES or tensor.device.type != "cpu":
                    inputs[name] = tensor
                    continue
                view = torch.frombuffer(self.memory.buf, dtype=tensor.dtype, count=tensor.numel(), offset=at).view(tensor.shape)
                view.copy_(tensor)
                del view
                inputs[name] = SharedTensor(self.memory.name, at, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
                at += -(-nbytes // 64) * 64
            shared.append(dataclasses.replace(item, encoder_inputs=type(item.encoder_inputs)(inputs)))
        self.used = at
        return shared

    def release(self) -> None:
        if self.memory is not None:
            self.memory.close()
            self.memory.unlink()
            self.memory = None


def take_shared(items: list[MMItem]) -> list[MMItem]:
    """The ranks' side: each handle's tensor copied into this process's memory (the segment is let go at once)."""
    opened: dict[str, shared_memory.SharedMemory] = {}
    try:
        taken = []
        for item in items:
            if not any(isinstance(t, SharedTensor) for t in item.encoder_inputs.values()):
                taken.append(item)
                continue
            inputs = {}
            for name, value in item.encoder_inputs.items():
                if isinstance(value, SharedTensor):
                    if value.segment not in opened:
                        # (the ranks share the driver's resource tracker, which keeps one entry per name: the
                        # driver's unlink is the one that removes it)
                        opened[value.segment] = shared_memory.SharedMemory(name=value.segment)
                    dtype = getattr(torch, value.dtype)
                    count = 1
                    for size in value.shape:
                        count *= size
                    view = torch.frombuffer(opened[value.segment].buf, dtype=dtype, count=count, offset=value.offset)
                    inputs[name] = view.view(value.shape).clone()
                    del view
                else:
                    inputs[name] = value
            taken.append(dataclasses.replace(item, encoder_inputs=type(item.encoder_inputs)(inputs)))
        return taken
    finally:
        for memory in opened.values():
            memory.close()
