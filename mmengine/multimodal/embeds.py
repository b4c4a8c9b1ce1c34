"""Precomputed image embeddings as an item kind: `{"image_embeds": tensor}` (plus `"image_grid_thw"`
for families whose positions need the picture's grid) where a picture would go.

The embeddings are the language model's input for the picture's placeholders (what the vision tower
and projector would have produced), `[N, hidden]` or `[1, N, hidden]`. They are checked here, keyed by
a content hash of the tensor (dtype, shape, bytes, and the grid), so the same embeddings hit the
prefix and encoder caches like the picture they came from would, and they never run the tower.
"""

from __future__ import annotations

from typing import Any

import torch

from mmengine.encoder_cache.hashing import new_hasher
from mmengine.errors import InvalidInputError
from mmengine.models.family import EncoderInputs

EMBEDS_KEYS = ("image_embeds", "image_grid_thw")


def is_embeds_item(item: object) -> bool:
    return isinstance(item, dict) and "image_embeds" in item


def check_embeds(item: dict[str, Any], hidden_size: int, needs_grid: bool, index: int) -> EncoderInputs:
    """The item as encoder inputs: embeddings [N, hidden] (a dense, finite, floating tensor) and,
    where positions need it, the grid [1, 3]. Anything else is an InvalidInputError naming image `index`."""
    where = f"image {index}"
    unknown = sorted(set(item) - set(EMBEDS_KEYS))
    if unknown:
        raise InvalidInputError(f"{where}: unknown key(s) {unknown} beside image_embeds; known: {list(EMBEDS_KEYS)}")
    embeds = item["image_embeds"]
    if not isinstance(embeds, torch.Tensor):
        raise InvalidInputError(f"{where}: image_embeds must be a torch.Tensor, got {type(embeds).__name__}")
    if embeds.layout != torch.strided or embeds.is_quantized:
        raise InvalidInputError(f"{where}: image_embeds must be a dense tensor, got layout {embeds.layout}")
    if not embeds.is_floating_point():
        raise InvalidInputError(f"{where}: image_embeds must be a floating-point tensor, got {embeds.dtype}")
    if embeds.dim() == 3:
        if embeds.shape[0] != 1:
            raise InvalidInputError(f"{where}: image_embeds holds {embeds.shape[0]} images ({tuple(embeds.shape)}); "
                                    "give one tensor per image")
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[0] < 1:
        raise InvalidInputError(f"{where}: image_embeds must be [N, hidden] or [1, N, hidden], got {tuple(item['image_embeds'].shape)}")
    if embeds.shape[1] != hidden_size:
        raise InvalidInputError(f"{where}: image_embeds has hidden size {embeds.shape[1]}, the language model's is {hidden_size}")
    embeds = embeds.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise InvalidInputError(f"{where}: image_embeds holds non-finite values (NaN or inf)")
    inputs = EncoderInputs(image_embeds=embeds)
    grid = item.get("image_grid_thw")
    if needs_grid:
        if grid is None:
            raise InvalidInputError(f"{where}: this model's positions need the picture's image_grid_thw beside image_embeds")
        grid = torch.as_tensor(grid)
        if grid.is_floating_point() or grid.numel() != 3 or bool((grid < 1).any()):
            raise InvalidInputError(f"{where}: image_grid_thw must be three positive ints (t, h, w), got {grid.tolist()}")
        inputs["image_grid_thw"] = grid.to(torch.long).view(1, 3)
    elif grid is not None:
        raise InvalidInputError(f"{where}: this model takes no image_grid_thw")
    return inputs


def hash_embeds(inputs: EncoderInputs, fingerprint: str, algo: str) -> str:
    """A content hash of the embeddings (dtype, shape, bytes) and grid, for this model."""
    embeds = inputs["image_embeds"]
    h = new_hasher(algo)
    for part in (b"image-embeds", fingerprint.encode(), str(embeds.dtype).encode(), str(tuple(embeds.shape)).encode()):
        h.update(part + b"\x00")
    h.update(embeds.view(torch.uint8).numpy().tobytes())
    grid = inputs.get("image_grid_thw")
    if grid is not None:
        h.update(b"grid" + str(grid.view(3).tolist()).encode())
    return h.hexdigest()
