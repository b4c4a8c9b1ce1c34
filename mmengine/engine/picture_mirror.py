"""Pictures an engine core already holds, so that each crosses from a front end once.

A front end sends a request's items with their pixel tensors in shared memory (engine/core_client.py). Each
crossing costs both processes a shared segment, a copy, and torch's descriptor hand-over (a connection and an
authentication handshake per tensor): next to a small model's step, more than the step. Yet most pictures of a
service come again (a chat's later turns, a shared picture), and the core needs a picture's pixels only to
encode it.

So each front end and the core keep the same books of the pictures that front end sent (vLLM v1's mirrored
processor caches): the front end's `SentPictures` holds each picture's key and size, the core's
`ReceivedPictures` (one per front end) its tensors, in private memory. Both apply the same operations in the
same order (the order of that front end's messages on its one connection) under the same least-recently-used
rule and byte capacity, so they evict the same pictures at the same message. An item whose picture the core
holds crosses without its tensors (`encoder_inputs` empty) and the core puts them back.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from mmengine.core.request import MMItem


def item_key(item: MMItem) -> tuple[str, str]:
    return item.modality, item.mm_hash


def item_bytes(item: MMItem) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in item.encoder_inputs.values())


class MirroredBooks:
    """Least-recently-used keys within a byte capacity, kept the same way on both sides."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._sizes: OrderedDict[tuple[str, str], int] = OrderedDict()

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, key: tuple[str, str]) -> None:
        self._sizes.move_to_end(key)

    def add(self, key: tuple[str, str], size: int) -> list[tuple[str, str]]:
        """Books a new key (none larger than the capacity is kept); returns the keys evicted to make room."""
        if size > self.capacity_bytes:
            return []
        evicted = []
        while self.num_bytes + size > self.capacity_bytes:
            old, old_size = self._sizes.popitem(last=False)
            self.num_bytes -= old_size
            evicted.append(old)
        self._sizes[key] = size
        self.num_bytes += size
        return evicted


class SentPictures:
    """The front end's side: which of its pictures the core holds."""

    def __init__(self, capacity_bytes: int) -> None:
        self.books = MirroredBooks(capacity_bytes)

    def strip(self, items: list[MMItem]) -> tuple[list[MMItem], int]:
        """The items as they cross (those the core holds without tensors), and how many crossed bare. Call in
        the order the requests are sent, one request at a time."""
        out, bare = [], 0
        for item in items:
            key = item_key(item)
            if not item.encoder_inputs:  # nothing to spare (never booked, on either side)
                out.append(item)
            elif key in self.books:
                self.books.touch(key)
                out.append(dataclasses.replace(item, encoder_inputs=type(item.encoder_inputs)()))
                bare += 1
            else:
                self.books.add(key, item_bytes(item))
                out.append(item)
        return out, bare


class ReceivedPictures:
    """The core's side for one front end: the pictures it sent, in private memory (so no shared segment or
    descriptor stays open per picture)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.books = MirroredBooks(capacity_bytes)
        self._inputs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def fill(self, items: list[MMItem]) -> list[MMItem]:
        """The items with their tensors: those that crossed bare from these books, the others booked (as the
        front end booked them). Call in the order the requests arrived."""
        out = []
        for item in items:
            key = item_key(item)
            if key in self.books:  # it crossed bare
                self.books.touch(key)
                item = dataclasses.replace(item, encoder_inputs=type(item.encoder_inputs)(self._inputs[key]))
            elif item.encoder_inputs:
                for old in self.books.add(key, item_bytes(item)):
                    del self._inputs[old]
                if key in self.books:  # kept: a private copy, and the shared segment goes with the message
                    private = {name: tensor.clone() for name, tensor in item.encoder_inputs.items()}
                    self._inputs[key] = private
                    item = dataclasses.replace(item, encoder_inputs=type(item.encoder_inputs)(private))
            out.append(item)
        return out
