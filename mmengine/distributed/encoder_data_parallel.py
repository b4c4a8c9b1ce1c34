"""`mm_encoder_tp_mode="data"` (vLLM's name): a step's items go through the vision tower split across the ranks
instead of every rank encoding all of them; each output is then broadcast from the rank that made it, so every
rank holds every entry of the (one, logical) encoder cache, as with the replicated tower.

Every rank calls `encode_items` with the same items (the same plan), so every rank computes the same split: the
items, largest first by their inputs' size (patch count), each to the rank with the least work so far. With LoRA
on the vision side, the adapters' context (each item's slot and rows, set by the runner for the whole call) is cut
to the rank's own items while it encodes them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.layers.lora import ItemLoRAContext

EncodeItems = Callable[[list[dict[str, torch.Tensor]]], list[torch.Tensor]]


def split_items(items: list[dict[str, torch.Tensor]], num_ranks: int) -> list[int]:
    """The rank that encodes each item: largest first, to the least loaded rank (ties: the lowest rank)."""
    cost = [sum(t.numel() for t in item.values() if isinstance(t, torch.Tensor)) for item in items]
    load = [0] * num_ranks
    owner = [0] * len(items)
    for index in sorted(range(len(items)), key=lambda i: (-cost[i], i)):
        rank = min(range(num_ranks), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += cost[index]
    return owner


def data_parallel_encoder(encode: EncodeItems, tp: TensorParallelGroup, lora: ItemLoRAContext | None = None) -> EncodeItems:
    """`encode` (a model's encode_items) with each call's items split across the ranks and the outputs shared.
    `lora`: the vision side's adapter context, whose items are the call's."""

    def encode_mine(items: list[dict[str, torch.Tensor]], mine: list[int]) -> list[torch.Tensor]:
        planned = lora.items if lora is not None else None
        if planned is None:
            return encode([items[i] for i in mine])
        lora.items = [planned[i] for i in mine]
        try:
            return encode([items[i] for i in mine])
        finally:
            lora.items = planned

    def encode_split(items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        if tp.size == 1 or len(items) < 2:
            return encode(items)
        owner = split_items(items, tp.size)
        mine = [i for i, rank in enumerate(owner) if rank == tp.rank]
        made = dict(zip(mine, encode_mine(items, mine))) if mine else {}
        shapes = [None] * tp.size
        dist.all_gather_object(shapes, {i: (tuple(t.shape), t.dtype) for i, t in made.items()}, group=tp.group)
        known = {i: spec for part in shapes for i, spec in part.items()}
        outputs = []
        for index, rank in enumerate(owner):
            tensor = made[index].contiguous() if rank == tp.rank else torch.empty(known[index][0], dtype=known[index][1],
                                                                                  device=tp.device)
            dist.broadcast(tensor, src=rank, group=tp.group)
            outputs.append(tensor)
        return outputs

    return encode_split
