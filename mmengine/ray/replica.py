"""One engine replica: an MMEngine that turns dataset rows into output rows.

Used as the body of a long-lived Ray actor (batch.py) and by the map_batches processor
(processor.py). Rows are plain dicts: `prompt` (str), `images` (a list of bytes / paths / pictures,
optional), `videos` (a list of encoded videos or paths, optional), `sampling_params` (a dict of SamplingParams fields, optional), `lora` (the name of a LoRA
adapter the replica registered from `lora_modules`, optional); other columns pass through.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmengine.errors import InvalidInputError

OUTPUT_COLUMNS = ("text", "token_ids", "finish_reason", "num_cached_tokens", "replica")


def row_images(value: Any) -> list[Any] | None:
    """A row's images as a list (Arrow hands lists back as numpy arrays); None when it has none."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike, bytes, bytearray, memoryview)):
        return [value]
    if isinstance(value, np.ndarray) and value.dtype != object and value.ndim >= 2:
        return [value]  # one decoded picture (H, W[, C])
    images = [bytes(v) if isinstance(v, np.bytes_) else v for v in value]
    return images or None


def row_sampling_params(value: Any, row: int) -> Any:
    """SamplingParams from a row's dict. Arrow fills fields other rows set with None: those are dropped."""
    from mmengine.sample.params import SamplingParams

    if value is None:
        return SamplingParams()
    if not isinstance(value, dict):
        raise InvalidInputError(f"row {row}: sampling_params must be a dict of SamplingParams fields, got {type(value).__name__}")
    fields = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in value.items() if v is not None}
    try:
        return SamplingParams(**fields)
    except TypeError as err:
        raise InvalidInputError(f"row {row}: bad sampling_params: {err}") from err


def check_columns(columns: Sequence[str]) -> None:
    if "prompt" not in columns:
        raise InvalidInputError(f"the dataset needs a 'prompt' column; it has {sorted(columns)}")
    clashes = sorted(set(columns) & set(OUTPUT_COLUMNS))
    if clashes:
        raise InvalidInputError(f"input columns {clashes} would be overwritten by the output; rename them")


@dataclass(frozen=True)
class ReplicaConfig:
    """What a replica's engine is built with after a runner's reconfigure; `version` counts them (0: the constructor's
    arguments, which are also what Ray restarts a crashed replica with)."""

    version: int
    engine_options: dict[str, Any]
    lora_modules: dict[str, str]
    encoder_store: Any = None  # the cluster's EncoderStore actor, or None


class EngineReplica:
    """Holds one MMEngine; `generate` answers a list of rows with one output dict per row."""

    def __init__(
        self, model: str, engine_options: dict[str, Any] | None, replica_id: int, num_threads: int | None = None,
        lora_modules: dict[str, str] | None = None, encoder_store: Any = None,
    ) -> None:
        """`encoder_store`: the cluster's EncoderStore actor (mmengine.ray.encoder_store), or None."""
        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        self.model = str(model)
        self.engine_options = dict(engine_options or {})
        self.replica_id = replica_id
        self.lora_modules = dict(lora_modules or {})
        self.encoder_store = encoder_store
        self.store_client = None
        self.config_version = 0
        self.engine = self._build()

    def _build(self) -> Any:
        from mmengine.engine.mm_engine import MMEngine
        from mmengine.lora.request import LoRARequest

        engine = MMEngine(self.model, **self.engine_options)
        for name, path in self.lora_modules.items():
            engine.add_lora(LoRARequest(name, str(path)))
        if self.encoder_store is not None:
            from mmengine.ray.encoder_store import EncoderStoreClient

            self.store_client = EncoderStoreClient(self.encoder_store, engine)
        return engine

    def ready(self) -> int:
        return self.replica_id

    def generate(self, rows: Sequence[dict[str, Any]], config: ReplicaConfig | None = None) -> list[dict[str, Any]]:
        """`config`: the runner's current one; a replica Ray restarted after a reconfigure came back with its
        constructor's options, and takes these before it answers."""
        if config is not None and config.version != self.config_version:
            self.reconfigure(config)
        prompts = [row["prompt"] for row in rows]
        images = [row_images(row.get("images")) for row in rows]
        videos = [row_images(row.get("videos")) for row in rows]
        params = [row_sampling_params(row.get("sampling_params"), i) for i, row in enumerate(rows)]
        loras = [row.get("lora") or None for row in rows]
        outputs = self.engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False,
                                       lora=loras if any(loras) else None, videos=videos if any(videos) else None)
        return [
            {
                "text": out.text,
                "token_ids": list(out.token_ids),
                "finish_reason": out.finish_reason,
                "num_cached_tokens": out.num_cached_tokens,
                "replica": self.replica_id,
            }
            for out in outputs
        ]

    def flush_encoder_store(self) -> bool:
        """Waits until this replica's encoder outputs so far are in the cluster store (True without one)."""
        return self.store_client.flush() if self.store_client is not None else True

    def stats(self) -> dict[str, int]:
        counts = dict(self.store_client.counts) if self.store_client is not None else {}
        return {**self.engine.stats(), **counts}

    def reset(self) -> None:
        """A fresh engine (empty caches, zeroed counters) in the same process: no restart cost."""
        self._replace_engine()

    def reconfigure(self, config: ReplicaConfig) -> None:
        """A fresh engine with other options, adapters and store, in the same process: another job's engine without
        an actor's start-up (a process importing torch, transformers and the model code: seconds of CPU)."""
        self.engine_options, self.lora_modules = dict(config.engine_options), dict(config.lora_modules)
        self.encoder_store = config.encoder_store
        self._replace_engine()
        self.config_version = config.version

    def _replace_engine(self) -> None:
        """Stops the engine's processes (tensor-parallel ranks, preprocessing workers) and its store client's thread
        (which held the engine), then builds the next one: the old engine, its KV cache with it, is freed first."""
        if self.store_client is not None:
            self.store_client.close()
            self.store_client = None
        self.engine.shutdown()
        self.engine = None
        self.engine = self._build()
