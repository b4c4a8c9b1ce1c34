"""Content hashes of full KV blocks, chained from the first block.

    h_i = H(h_{i-1}, token ids of block i, extra keys of block i)

Extra keys carry what else determines a block's KV besides its tokens: the request's LoRA
identity (every block), `(modality, mm_hash, block_start - item_offset)` for every
multimodal item overlapping the block, and the request's cache salt (block 0 only; it
reaches every later block through the chain). A hash only finds a candidate block: the
block pool compares tokens, extra keys and parent before it calls anything a hit.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from mmengine.config import HASH_ALGORITHMS

if TYPE_CHECKING:  # annotations only: hashing a block needs no torch
    from mmengine.core.request import MMItem, Request

BlockHash = bytes
ExtraKey = tuple[object, ...]
HashFunction = Callable[[bytes], BlockHash]



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
    extend_chain(hashes, token_ids, mm_items, cache_salt, lora_name, block_size, hash_fn)
    return hashes


def extend_chain(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    mm_items: Sequence[MMItem],
    cache_salt: str | None,
    lora_name: str | None,
    block_size: int,
    hash_fn: HashFunction,
) -> int:
    """Appends to `hashes` (the chain of the first len(hashes) blocks) the hashes of the remaining
    full blocks of `token_ids`; returns how many it appended. Each block's bytes are exactly
    `_encode(parent, block_key_of(...))`, assembled without building the key: the new blocks'
    tokens are packed in one call, and an item's or adapter's bytes are encoded once."""
    first, stop = len(hashes), len(token_ids) // block_size
    if first >= stop:
        return 0
    packed = _pack_token_ids(token_ids[first * block_size : stop * block_size])
    width = 8 * block_size
    count = struct.pack("<I", block_size)
    lora = _encode_extra(("lora", lora_name)) if lora_name is not None else b""
    parent = hashes[-1] if hashes else None
    for index in range(first, stop):
        start = index * block_size
        offset = (index - first) * width
        parts = [b"\x00" if parent is None else b"\x01" + parent, count, packed[offset : offset + width], lora]
        for item in mm_items:
            if item.overlaps(start, start + block_size):
                parts.append(_encode_extra((item.modality, item.mm_hash, start - item.offset)))
        if index == 0 and cache_salt is not None:
            parts.append(_encode_extra(("salt", cache_salt)))
        parent = hash_fn(b"".join(parts))
        hashes.append(parent)
    return stop - first


def _encode(parent: BlockHash | None, key: BlockKey) -> bytes:
    """The bytes a block's hash is taken of (the definition extend_chain's fast path must equal)."""
    parts = [b"\x01" + parent if parent is not None else b"\x00"]
    parts.append(struct.pack(f"<I{len(key.token_ids)}q", len(key.token_ids), *key.token_ids))
    parts.extend(_encode_extra(extra) for extra in key.extra_keys)
    return b"".join(parts)


@functools.lru_cache(maxsize=4096)  # a picture's (modality, hash, relative offset) recurs in every prompt showing it
def _encode_extra(extra: ExtraKey) -> bytes:
    parts = []
    for field in extra:
        data = field.encode() if isinstance(field, str) else struct.pack("<q", field)
        parts.append(struct.pack("<cI", b"s" if isinstance(field, str) else b"i", len(data)) + data)
    parts.append(b"|")
    return b"".join(parts)


def _pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Little-endian int64s, as struct's "<q" packs them."""
    packed = array("q", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


class BlockHasher:
    """Extends a request's block hashes to cover its full blocks; each block is hashed once."""

    def __init__(self, block_size: int, hash_fn: HashFunction) -> None:
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.num_hashed = 0  # blocks hashed so far (all requests)

    def update(self, request: Request) -> None:
        self.num_hashed += extend_chain(
            request.block_hashes, request.all_token_ids, request.mm_items, request.cache_salt, request.lora_name,
            self.block_size, self.hash_fn,
        )
