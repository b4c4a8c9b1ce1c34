"""The encoder cache's host tier: encoder outputs evicted from the device wait in (pinned) host
memory, LRU by bytes, instead of being dropped; a request that needs one again gets it back by an
asynchronous copy issued in the step that reads it, in place of a vision-tower run.

The tier is inclusive: an output copied back stays here too, so evicting it from the device again
costs no copy. The scheduler asks `holds` (is a copy-back possible) and the runner moves tensors;
the device-side books stay with EncoderCacheManager. A copy that cannot be made (the tier full of
larger entries, an entry evicted meanwhile) means the item is encoded, never a wrong result.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from mmengine.utils.host_memory import available_host_memory

_MAX_DEFAULT_BYTES = 32 << 30


def host_tier_bytes(configured: int | None, device_type: str) -> int:
    """encoder_cache_host_bytes resolved: None is a tenth of the available RAM (at most 32 GiB) on
    CUDA and 0 on CPU, where the device tier is host memory already."""
    if configured is not None:
        return configured
    return min((available_host_memory() or 0) // 10, _MAX_DEFAULT_BYTES) if device_type == "cuda" else 0


class EncoderHostTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0  # items brought back instead of encoded
        self.num_stored = 0  # device evictions kept here
        self.num_evictions = 0  # entries dropped from the host tier for room
        self.bytes_in = 0  # copied device -> host
        self.bytes_out = 0  # copied host -> device

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def store(self, mm_hash: str, output: torch.Tensor) -> None:
        """Keeps a copy of an output the device evicts (nothing to copy if one is here already)."""
        if mm_hash in self._entries:
            self._entries.move_to_end(mm_hash)
            return
        size = output.numel() * output.element_size()
        if size > self.capacity_bytes:
            return
        while self.num_bytes + size > self.capacity_bytes:
            self.drop(next(iter(self._entries)))
            self.num_evictions += 1
        if output.device.type == "cuda":
            host = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
            host.copy_(output, non_blocking=True)  # ordered after the step that made it; read only by later copies
        else:
            host = output  # already in host memory: the device tier and this one share it
        self._entries[mm_hash] = host
        self.num_bytes += size
        self.num_stored += 1
        self.bytes_in += size

    def load(self, mm_hash: str, device: torch.device) -> torch.Tensor:
        """The output on `device`, by a copy queued on the current stream (no wait)."""
        host = self._entries[mm_hash]
        self._entries.move_to_end(mm_hash)
        self.num_hits += 1
        self.bytes_out += host.numel() * host.element_size()
        return host.to(device, non_blocking=True) if host.device != device else host

    def drop(self, mm_hash: str) -> None:
        """Forgets the copy of `mm_hash`, if one is here."""
        dropped = self._entries.pop(mm_hash, None)
        if dropped is not None:
            self.num_bytes -= dropped.numel() * dropped.element_size()

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0
