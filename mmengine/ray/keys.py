"""Sharing keys, computed on the driver without model weights: rows with equal keys share cached state.

- A row with images is keyed by its first image's content: encoded bytes for a file path or bytes
  (read, not decoded: cheap on the driver), canonical pixel bytes for a decoded picture (PIL image or
  numpy array). The same file given as a path or as its bytes gets the same key.
- A text-only row is keyed by its prefix-sharing group: the prompt is tokenized with the checkpoint's
  tokenizer, its full blocks are hashed into the same chains the engine's prefix cache uses
  (kv_cache/block_hash.py), and the chains are grouped by core/prefix_groups.py, so every member of a group
  gets the group's key. A row that shares no block with any other gets no key (None): any replica
  serves it equally well.

Keys only place rows; the engines still verify every reuse, so a key collision costs cache hits, never
correctness.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmengine.encoder_cache.hashing import hash_bytes, new_hasher
from mmengine.errors import InvalidInputError
from mmengine.kv_cache.block_hash import hash_chain, make_hash_function
from mmengine.multimodal.image_loading import encoded_bytes, image_content_bytes
from mmengine.core.prefix_groups import plan_prefix_groups

SharingKey = str | None


def image_key(image: Any, algo: str = "xxh3_128") -> str:
    """The content hash of one image input (path, encoded bytes, PIL image or numpy array)."""
    data = encoded_bytes(image)
    if data is None:
        if isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        if isinstance(image, (str, os.PathLike)):  # a file too large to read whole: hash it streaming
            hasher = new_hasher(algo)
            with open(image, "rb") as file:
                while chunk := file.read(1 << 20):
                    hasher.update(chunk)
            return "image:" + hasher.hexdigest()
        if isinstance(image, Image.Image):
            data = image_content_bytes(image)
        else:
            raise InvalidInputError(f"cannot key an image of type {type(image).__name__}")
    return "image:" + hash_bytes(data, algo)


def first_image(images: Any) -> Any | None:
    """A row's first image, or None for a row without images (None, or an empty list)."""
    if images is None:
        return None
    if isinstance(images, (str, os.PathLike, bytes, bytearray, memoryview, Image.Image)):
        return images  # a single image given without a list
    items = list(images)
    return items[0] if items else None


class SharingKeys:
    """Computes rows' sharing keys for one checkpoint: loads only its tokenizer, never its weights."""

    def __init__(self, model: str | os.PathLike, block_size: int = 16, hash_algo: str = "xxh3_128") -> None:
        from mmengine.models.registry import load_hf_tokenizer

        self.block_size = block_size
        self.hash_algo = hash_algo
        self.tokenizer = load_hf_tokenizer(Path(model))
        # A fixed seed: keys are compared only with each other, within one placement.
        self._hash_fn = make_hash_function(hash_algo, 0)

    def prefix_chain(self, prompt: str) -> list[bytes]:
        """The block-hash chain of a text prompt's full blocks, as the engine's prefix cache hashes them."""
        token_ids = self.tokenizer(prompt)["input_ids"]
        return hash_chain(token_ids, [], None, None, self.block_size, self._hash_fn)

    def keys(self, prompts: Sequence[str], images: Sequence[Any]) -> list[SharingKey]:
        """One key per row: its first image's key if it shows any, else its prefix group's key."""
        keys: list[SharingKey] = [None] * len(prompts)
        text_rows: list[int] = []
        for row, (prompt, row_images) in enumerate(zip(prompts, images, strict=True)):
            image = first_image(row_images)
            if image is not None:
                keys[row] = image_key(image, self.hash_algo)
            else:
                text_rows.append(row)
        chains = [self.prefix_chain(prompts[row]) for row in text_rows]
        for group in plan_prefix_groups(chains):
            key = "prefix:" + group.prefix[-1].hex()  # the last shared block's hash names the whole chain
            for member in group.members:
                keys[text_rows[member]] = key
        return keys
