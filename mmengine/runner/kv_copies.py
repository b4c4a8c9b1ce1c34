"""The copies of KV blocks between the device's cache and the host tier, queued at the start of a step.

It owns how a step's tier moves reach the device: the evicted blocks gathered in one launch and each copied into a
host buffer of its own (pinned on a GPU, with one event that says when they have all landed), then the host-tier hits
stacked and written back in one transfer and one scatter, after waiting for any of them still on its way to the host.
The scheduler decides which blocks move (kv_cache/host_tier.py); this only moves them.
"""

from __future__ import annotations

import torch

from mmengine.kv_cache.host_tier import KVCopy
from mmengine.runner.kv_tensors import PagedKVTensors


@torch.inference_mode()
def copy_kv_blocks(kv_cache: PagedKVTensors, device: torch.device, offloads: list[KVCopy], restores: list[KVCopy]) -> None:
    """Queues the step's copies between the KV tiers before anything else of the step, batched: the
    evicted blocks gathered in one launch and copied to host memory, then the host-tier hits stacked
    and copied back in one transfer and one scatter."""
    if offloads:
        ids = torch.tensor([c.block_id for c in offloads]).to(device, non_blocking=True)
        gathered = kv_cache.gather_blocks(ids)  # per layer shape [layers, 2, n, block_size, heads, dim]
        pin = device.type == "cuda"
        for index, copy in enumerate(offloads):
            parts = []
            for group in gathered:
                block = group[:, :, index]
                host = torch.empty(block.shape, dtype=block.dtype, pin_memory=pin)
                host.copy_(block, non_blocking=pin)  # its own buffer: an entry never keeps the batch alive
                parts.append(host)
            copy.entry.kv, copy.done = parts, True
        if pin:
            copied = torch.cuda.Event()
            copied.record()
            for copy in offloads:
                copy.entry.copied = copied
    if restores:
        ids = torch.tensor([c.block_id for c in restores]).to(device, non_blocking=True)
        for copy in restores:
            # a block offloaded a step or two ago (the host runs ahead of the device under async scheduling)
            # may still be on its way to host memory: the stack below reads it on the host
            if copy.entry.copied is not None:
                copy.entry.copied.synchronize()
        stacked = [torch.stack([c.entry.kv[g] for c in restores], dim=2) for g in range(len(restores[0].entry.kv))]
        if device.type == "cuda":
            stacked = [part.pin_memory() for part in stacked]
        kv_cache.scatter_blocks(ids, stacked)
        for copy in restores:
            copy.done = True
