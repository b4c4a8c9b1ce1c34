"""mmengine on Ray: data-parallel engine replicas with cache-affine placement.

Offline (Ray Data): `run_batch(ds, model=..., num_replicas=N)` and `BatchRunner`, which place rows
that share an image or a text prefix on the same replica, and `MMEngineProcessor` for
`Dataset.map_batches`. Online (Ray Serve): `build_app` / `run_app` (mmengine.ray.serve), N engine
replicas behind a cache-aware router (`mmengine serve --data-parallel-size N`). Names are imported
on first use, so `import mmengine` never imports Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmengine.utils.lazy_exports import lazy_exports

__all__ = [
    "BatchResult", "BatchRunner", "MMEngineProcessor", "SharingKeys", "build_app", "image_key", "place_rows", "run_app",
    "run_batch",
]

_EXPORTS = {
    "BatchResult": "mmengine.ray.batch",
    "BatchRunner": "mmengine.ray.batch",
    "MMEngineProcessor": "mmengine.ray.processor",
    "run_batch": "mmengine.ray.batch",
    "SharingKeys": "mmengine.ray.keys",
    "image_key": "mmengine.ray.keys",
    "place_rows": "mmengine.ray.placement",
    "build_app": "mmengine.ray.serve",
    "run_app": "mmengine.ray.serve",
}

if TYPE_CHECKING:
    from mmengine.ray.batch import BatchResult, BatchRunner, run_batch
    from mmengine.ray.keys import SharingKeys, image_key
    from mmengine.ray.placement import place_rows
    from mmengine.ray.processor import MMEngineProcessor
    from mmengine.ray.serve import build_app, run_app


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
