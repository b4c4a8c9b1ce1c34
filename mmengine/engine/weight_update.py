"""What `MMEngine.update_weights` takes (a mapping, (name, tensor) pairs, or a checkpoint directory) as
one stream of checkpoint tensors, and which caches a set of updated weights makes stale."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Union

import torch

from mmengine.errors import InvalidInputError
from mmengine.models.loader import iter_checkpoint
from mmengine.engine.prompt_inputs import type_name

WeightsSource = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]], str, os.PathLike]


def weight_stream(weights: WeightsSource) -> Iterable[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs from a state dict, an iterable of pairs, or a directory of
    safetensors files (sharded or not, as a checkpoint is saved); anything else is InvalidInputError."""
    if isinstance(weights, (str, os.PathLike)):
        path = Path(weights)
        if not path.is_dir():
            raise InvalidInputError(f"update_weights: {os.fspath(weights)!r} is not a checkpoint directory "
                                    "(for one .safetensors file, pass safetensors.torch.load_file(path))")
        return iter_checkpoint(path)
    if isinstance(weights, Mapping):
        return _checked_pairs(weights.items())
    if isinstance(weights, Iterable) and not isinstance(weights, (bytes, torch.Tensor)):
        return _checked_pairs(weights)
    raise InvalidInputError(f"update_weights takes a state dict, (name, tensor) pairs or a checkpoint directory, "
                            f"got {type_name(weights)}")


def _checked_pairs(pairs: Iterable[object]) -> Iterator[tuple[str, torch.Tensor]]:
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], torch.Tensor)):
            raise InvalidInputError(f"update_weights: item {index} is not a (name, tensor) pair: {type_name(pair)}")
        yield pair


def updates_encoders(names: Iterable[str]) -> bool:
    """Whether any of the updated weights (the model's names for them) is outside the decoder and its LM head: a vision
    or audio tower or projector, whose cached outputs the update makes stale."""
    return any(not (name.startswith("language_model.") or name == "lm_head.weight") for name in names)
