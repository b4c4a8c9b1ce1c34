"""`update_weights` on one tensor-parallel rank: new values for some of the model's weights, each checked against
the whole model's shapes as at TP 1 (`models/vlm.py` update_weights: an unknown name, one given twice, a wrong
shape or a KV scale raises WeightsMismatchError naming it), and this
rank's part of each copied in place by its parallel layer's weight loader, exactly as at load time (column, row
and vocabulary splits, q/k/v and gate/up pieces, experts).

The driver sends an update in chunks (`runner/parallel_runner.py`); one WeightCheck spans them all
(`model.update_check`, reset by the first), so a name given twice is refused across chunks too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mmengine.distributed.checkpoint_slices import load_parameter, target_of
from mmengine.distributed.quantized_parallel import runs_quantized
from mmengine.models.loader import WeightCheck
from mmengine.models.vlm import checked_updates


def update_sharded_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], loaded: list[str],
                           expected: dict[str, tuple[int, ...]]) -> None:
    """Loads this rank's part of each (checkpoint name, whole tensor), appending our name of each to `loaded`; those
    before a refused one stay loaded (as at TP 1). `expected`: the whole model's shapes, before the split."""
    check = getattr(model, "update_check", None)
    if check is None:
        check = model.update_check = WeightCheck(expected, weights, optional=["lm_head.weight"] if model.tie_word_embeddings else [])
    for name, tensor in checked_updates(model, weights, expected, check, lambda name: runs_quantized(model, name)):
        parameter, piece = target_of(model, name)
        with torch.no_grad():
            load_parameter(parameter, tensor, piece, name)
        loaded.append(name)
