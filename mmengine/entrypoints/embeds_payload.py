"""Image embeddings sent over HTTP (`{"type": "image_embeds", "image_embeds": ...}` content parts, with
`--enable-mm-embeds`): base64 of `torch.save(tensor)`, or of a dict with exactly `image_embeds` and
`image_grid_thw`, as vLLM accepts them.

These bytes are untrusted. They are size-checked before decoding, unpickled only by torch's
`weights_only` loader (no arbitrary objects), with sparse-tensor invariants checked as tensors are
built, and then accepted only as dense, strided tensors: the embeddings floating-point, the grid
integer. Nothing the payload describes is touched (no densify, no reshape) before those checks.
(vLLM's CVE-2025-62164 was memory corruption from a crafted sparse tensor turned dense.)
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any

import torch

from mmengine.entrypoints.api_errors import APIError

MAX_EMBEDS_BYTES = 64 * 1024 * 1024  # one image's embeddings; a 7B model's 576 x 4096 fp32 are 9.4 MB


def _bad(index: int, reason: str) -> APIError:
    return APIError(400, f"image {index}: {reason}", param="messages", code="invalid_image_embeds")


def decode_embeds_payload(payload: Any, index: int, max_bytes: int = MAX_EMBEDS_BYTES) -> dict[str, torch.Tensor]:
    """The content part's payload as an embeddings item {"image_embeds": tensor[, "image_grid_thw": tensor]}."""
    if isinstance(payload, dict):  # {"image_embeds": b64, "image_grid_thw": b64 or [t, h, w]}
        unknown = sorted(set(payload) - {"image_embeds", "image_grid_thw"})
        if unknown or "image_embeds" not in payload:
            raise _bad(index, f"an image_embeds object holds 'image_embeds' (and 'image_grid_thw'), got keys {sorted(payload)}")
        item = {"image_embeds": _tensor(_load(payload["image_embeds"], index, max_bytes), index, "image_embeds")}
        grid = payload.get("image_grid_thw")
        if grid is not None:
            grid = grid if isinstance(grid, list) else _load(grid, index, max_bytes)
            item["image_grid_thw"] = _grid(grid, index)
        return item
    loaded = _load(payload, index, max_bytes)
    if isinstance(loaded, dict):
        if set(loaded) - {"image_embeds", "image_grid_thw"} or "image_embeds" not in loaded:
            raise _bad(index, f"a saved dict must hold exactly 'image_embeds' (and 'image_grid_thw'), got {sorted(map(str, loaded))}")
        item = {"image_embeds": _tensor(loaded["image_embeds"], index, "image_embeds")}
        if "image_grid_thw" in loaded:
            item["image_grid_thw"] = _grid(loaded["image_grid_thw"], index)
        return item
    return {"image_embeds": _tensor(loaded, index, "image_embeds")}


def _load(encoded: Any, index: int, max_bytes: int) -> Any:
    if not isinstance(encoded, str) or not encoded:
        raise _bad(index, "image_embeds must be a base64 string of torch.save(tensor)")
    if len(encoded) > (max_bytes * 4) // 3 + 4:
        raise _bad(index, f"image_embeds is larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(index, "image_embeds is not valid base64") from None
    try:
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, OSError, TypeError, AttributeError) as err:
        raise _bad(index, f"image_embeds is not a tensor saved with torch.save (refused: {type(err).__name__}: "
                          f"{str(err).splitlines()[0][:200] if str(err) else ''})") from None


def _tensor(value: Any, index: int, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _bad(index, f"{name} must be a tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.is_quantized or value.is_sparse:
        raise _bad(index, f"{name} must be a dense tensor, got layout {value.layout}{' (quantized)' if value.is_quantized else ''}")
    if not value.is_floating_point():
        raise _bad(index, f"{name} must be a floating-point tensor, got {value.dtype}")
    return value


def _grid(value: Any, index: int) -> torch.Tensor:
    if isinstance(value, list):
        if len(value) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise _bad(index, f"image_grid_thw must be three ints, got {value!r:.60}")
        return torch.tensor(value)
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_floating_point() or value.numel() != 3:
        raise _bad(index, "image_grid_thw must be a dense integer tensor of three values (t, h, w)")
    return value
