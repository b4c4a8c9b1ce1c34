"""Reading checkpoint tensors from safetensors files, sharded or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from mmengine.errors import UnsupportedModelError

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / _INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    elif (model_dir / _SINGLE).exists():
        files = [model_dir / _SINGLE]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"no safetensors weights found in {model_dir} (.bin checkpoints are not supported)")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise UnsupportedModelError(f"checkpoint {model_dir} is missing weight files: {', '.join(missing)}")
    return files


def iter_checkpoint(model_dir: Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of the checkpoint, one file open at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_dtype(model_dir: Path) -> torch.dtype | None:
    """The floating dtype the checkpoint stores its weights in (read from one tensor header)."""
    path = safetensors_files(model_dir)[0]
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            dtype = f.get_slice(name).get_dtype()
            return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(dtype)
    return None
