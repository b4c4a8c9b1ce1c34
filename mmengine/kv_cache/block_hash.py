"""Content hashes of full KV blocks, chained from the first block.

    h_i = H(h_{i-1}, token ids of block i, extra keys of block i)

Extra keys carry what else determines a block's KV besides its tokens: the request's LoRA
identity (every block), `(modality, mm_hash, block_start - item_offset)` for every
multimodal item overlapping the block, and the request's cache salt (block 0 only; it
reaches every later block through the chain). A hash only finds a candidate block: the
block pool compares tokens, extra keys and parent before it calls anything a hit.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:  # annotations only: EngineConfig reads HASH_ALGORITHMS here without importing torch
    from mmengine.request import MMItem, Request

BlockHash = bytes
ExtraKey = tuple[object, ...]
HashFunction = Callable[[bytes], BlockHash]

HASH_ALGORITHMS = ("xxh3_128", "sha256")


def make_hash_function(algo: str, seed: int | None) -> HashFunction:
    """A keyed hash: the seed is random per process unless given, so hashes are not predictable across processes."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    if algo == "xxh3_128":
        return lambda data: xxhash.xxh3_128_digest(data, seed=seed)
    if algo == "sha256":
        prefix = seed.to_bytes(8, "little")
        return lambda data: hashlib.sha256(prefix + data).digest()
    raise ValueError(f"unknown hash algorithm {algo!r}; known: {', '.join(HASH_ALGORITHMS)}")


@dataclass(frozen=True)
class BlockKey:
    """Everything that determines a block's KV besides its parent: what a lookup verifies."""

    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...]


def block_key(request: Request, block_index: int, block_size: int) -> BlockKey:
    return block_key_of(request.all_token_ids, request.mm_items, request.cache_salt, request.lora_name, block_index, block_size)


def block_key_of(
    token_ids: Sequence[int],
    mm_items: Sequence[MMItem],
    cache_salt: str | None,
    lora_name: str | None,
    block_index: int,
    block_size: int,
) -> BlockKey:
    """A block's identity from what determines it, without a live Request (offline grouping uses it)."""
    start, end = block_index * block_size, (block_index + 1) * block_size
    extra: list[ExtraKey] = []
    if lora_name is not None:
        extra.append(("lora", lora_name))
    for item in mm_items:
        if item.overlaps(start, end):
            extra.append((item.modality, item.mm_hash, start - item.offset))
    if block_index == 0 and cache_salt is not None:
        extra.append(("salt", cache_salt))
    return BlockKey(tuple(token_ids[start:end]), tuple(extra))


def hash_chain(
    token_ids: Sequence[int],
    mm_items: Sequence[MMItem],
    cache_salt: str | None,
    lora_name: str | None,
    block_size: int,
    hash_fn: HashFunction,
) -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids`: equal to what BlockHasher gives a
    Request with the same tokens, items, salt and adapter."""
    hashes: list[BlockHash] = []
    for index in range(len(token_ids) // block_size):
        key = block_key_of(token_ids, mm_items, cache_salt, lora_name, index, block_size)
        hashes.append(hash_fn(_encode(hashes[-1] if hashes else None, key)))
    return hashes


def _encode(parent: BlockHash | None, key: BlockKey) -> bytes:
    parts = [b"\x01" + parent if parent is not None else b"\x00"]
    parts.append(struct.pack(f"<I{len(key.token_ids)}q", len(key.token_ids), *key.token_ids))
    for extra in key.extra_keys:
        for field in extra:
            data = field.encode() if isinstance(field, str) else struct.pack("<q", field)
            parts.append(struct.pack("<cI", b"s" if isinstance(field, str) else b"i", len(data)) + data)
        parts.append(b"|")
    return b"".join(parts)


class BlockHasher:
    """Extends a request's block hashes to cover its full blocks; each block is hashed once."""

    def __init__(self, block_size: int, hash_fn: HashFunction) -> None:
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.num_hashed = 0  # blocks hashed so far (all requests)

    def update(self, request: Request) -> None:
        hashes = request.block_hashes
        for index in range(len(hashes), request.num_tokens // self.block_size):
            parent = hashes[-1] if hashes else None
            hashes.append(self.hash_fn(_encode(parent, block_key(request, index, self.block_size))))
            self.num_hashed += 1
