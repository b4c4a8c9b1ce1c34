"""MMEngineProcessor: a callable class for `Dataset.map_batches`.

    ds.map_batches(MMEngineProcessor, fn_constructor_kwargs={"model": PATH, "engine_options": {...}},
                   compute=ray.data.ActorPoolStrategy(size=N), batch_size=256, num_gpus=1)

Ray Data runs N actors, each holding one MMEngine, and feeds them batches in dataset order: within a
batch the engine shares images and prefixes, across batches each actor's caches help only by chance.
`run_batch` adds cache-affine placement on top (rows sharing a key meet on one replica).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmengine.ray.replica import OUTPUT_COLUMNS, EngineReplica, check_columns


class MMEngineProcessor:
    def __init__(self, model: str, engine_options: dict[str, Any] | None = None, replica_id: int = 0) -> None:
        self.replica = EngineReplica(model, engine_options, replica_id)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        check_columns(list(batch))
        num_rows = len(batch["prompt"])
        rows = [{name: column[i] for name, column in batch.items()} for i in range(num_rows)]
        outputs = self.replica.generate(rows)
        result = dict(batch)
        for name in OUTPUT_COLUMNS:
            values = [out[name] for out in outputs]
            result[name] = np.array(values, dtype=object) if name == "token_ids" else np.array(values)
        return result
