"""The garbage collector's view of a serving process: what start-up built (torch, transformers, the model, the
server) lives as long as the process, so it is moved out of the collector's reach once, before serving."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects what start-up left behind, then freezes every object alive (gc.freeze): the collector's full
    passes no longer walk them. Without it, a full pass over a tiny model's server walked ~450k start-up objects,
    250 ms of CPU with the GIL held, every few hundred requests. Returns how many objects were frozen.

    Frozen objects are still freed when their last reference goes; only a reference cycle among them would
    outlive its use (start-up builds none that it later drops)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
