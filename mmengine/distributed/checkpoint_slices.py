"""One rank's read of a checkpoint: every tensor as a safetensors slice, one file open at a time.

A slice holds the header only; a parallel layer's weight loader indexes it for this rank's rows, and only
those bytes are read (from the page cache or the disk). A slice is valid while its file is open: load it
inside the loop. The same files as `models/loader.py` reads (an index, one file, or every *.safetensors),
with the same refusals: a name stored twice, a file that is not safetensors, each naming the file.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from mmengine.distributed.sharding import Loaded, TensorSlice, copy_into
from mmengine.errors import CheckpointError
from mmengine.models.llama import STACKED_PROJECTIONS
from mmengine.models.loader import CheckpointFiles


class CheckpointSlice:
    """A safetensors slice with the `.shape` a tensor has (the whole tensor's, from the header), so that
    `models/loader.py`'s WeightCheck checks it as it checks a tensor; indexing reads only the rows asked for."""

    def __init__(self, raw: TensorSlice) -> None:
        self.raw = raw
        self.shape = torch.Size(raw.get_shape())

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        return self.raw[index]


class CheckpointSlices(CheckpointFiles):
    """(name, slice) for every tensor of the checkpoint in `model_dir`; remembers each name's file, which
    `where` names (WeightCheck's errors do, given this as their source)."""

    def __iter__(self) -> Iterator[tuple[str, CheckpointSlice]]:
        for path in self.files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError, RuntimeError) as err:
                raise CheckpointError(f"not a readable safetensors file (truncated or corrupt?): {err}", path) from err
            with handle as f:
                for name in self._names(f, path):
                    yield name, CheckpointSlice(f.get_slice(name))


def load_parameter(param: torch.nn.Parameter, loaded: Loaded, shard_id: object = None, name: str = "") -> None:
    """Loads `param` through its parallel layer's `weight_loader` (this rank's share), or whole when it has none
    (a replicated parameter: a norm, a rotary table)."""
    weight_loader = getattr(param, "weight_loader", None)
    if weight_loader is None:
        whole = loaded if isinstance(loaded, torch.Tensor) else loaded[...]  # (a 0-dim tensor too)
        copy_into(param, whole, name or "a replicated parameter")
    elif shard_id is None:
        weight_loader(param, loaded)
    else:
        weight_loader(param, loaded, shard_id)


def target_of(model: nn.Module, name: str) -> tuple[nn.Parameter, object]:
    """The parameter a checkpoint tensor (our name) loads into, and which piece of it (q/k/v, gate/up) or None."""
    parts = name.split(".")
    if name.startswith(("language_model.layers.", "mtp.layers.")) and len(parts) >= 6 and parts[-2] in STACKED_PROJECTIONS:
        fused, piece = STACKED_PROJECTIONS[parts[-2]]
        try:
            return model.get_parameter(".".join([*parts[:-2], fused, parts[-1]])), piece
        except AttributeError:  # a layer that keeps its projections apart (Qwen3.5's gated attention)
            pass
    try:
        return model.get_parameter(name), None
    except AttributeError:  # a buffer the checkpoint holds (Gemma 4's layer_scalar): whole on every rank
        return model.get_buffer(name), None
