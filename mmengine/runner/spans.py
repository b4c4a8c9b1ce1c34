"""Bidirectional picture spans of a step (Gemma 4): how far each new token may see.

On the layers that attend both ways inside a picture, a token of a picture's placeholder run sees every
key up to the run's last position; any other token sees up to itself. The scheduler keeps each run in
one chunk, so those keys are all in the cache when the step attends.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mmengine.core.scheduler import ScheduledRequest


def span_ends(scheduled: Sequence[ScheduledRequest], modalities: frozenset[str], device: torch.device) -> torch.Tensor | None:
    """[new tokens] int32 in packed order: the last position each token may attend to on a
    bidirectional layer; None when no scheduled token lies in a span."""
    parts = []
    inside = False
    for s in scheduled:
        ends = np.arange(s.start, s.end, dtype=np.int32)
        for item in s.request.mm_items:
            if item.modality in modalities and item.overlaps(s.start, s.end):
                lo, hi = max(s.start, item.offset), min(s.end, item.end)
                ends[lo - s.start:hi - s.start] = item.end - 1
                inside = True
        parts.append(ends)
    if not inside:
        return None
    return torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
