"""run_batch and BatchRunner: offline batch inference over data-parallel engine replicas on Ray.

The driver reads the rows (all at once, or `window_rows` at a time so its memory stays bounded),
computes each row's sharing key (keys.py: no weights needed), places rows on replicas (placement.py;
a key keeps its replica from one window to the next), and sends each replica its rows in
sub-batches, in grouped order. Each
replica is a long-lived Ray actor holding one MMEngine (one GPU with num_gpus=1, else a CPU slot), so
its prefix and encoder caches carry over from one sub-batch to the next.

Faults: actors restart (max_restarts) and Ray retries their calls (max_task_retries). A replica that
is gone for good has its unfinished sub-batches sent to a live replica (all to the same one, so they
keep sharing). Results are collected by a row index added on the driver and dropped from the output:
a row that is answered twice is kept once, and a missing row is an error, never silently dropped.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from mmengine.errors import ConfigError
from mmengine.ray.keys import SharingKeys
from mmengine.ray.placement import Placement, place_rows
from mmengine.ray.replica import EngineReplica, ReplicaConfig, check_columns
from mmengine.ray.routing import with_adapter

AFFINITIES = ("prefix+image", None)
ProgressHook = Callable[["BatchRunner", int, int], None]  # (runner, replica, rows done so far)


@dataclass
class BatchResult:
    dataset: Any  # a materialized ray.data.Dataset: input columns + text, token_ids, finish_reason, num_cached_tokens, replica
    replica_stats: list[dict[str, int] | None]  # engine.stats() per replica; None for a replica that died
    placement: Placement  # where each row was planned to run
    num_retried_rows: int  # rows re-sent to another replica after theirs died


class BatchRunner:
    """`num_replicas` long-lived engine actors; `run(ds)` may be called many times (caches persist)."""

    def __init__(
        self,
        model: str | os.PathLike,
        num_replicas: int = 1,
        engine_options: dict[str, Any] | None = None,
        num_gpus: float = 0,
        num_cpus: float | None = None,
        batch_size: int = 64,
        max_restarts: int = 1,
        max_task_retries: int = 1,
        lora_modules: dict[str, str] | None = None,
        encoder_store_bytes: int = 0,
    ) -> None:
        """`lora_modules` ({name: PEFT directory}) are registered on every replica (with
        engine_options' enable_lora=True); a row's `lora` column names the adapter it runs under.
        `encoder_store_bytes` > 0 shares encoder outputs among the replicas through a cluster-wide store
        of that many bytes (mmengine.ray.encoder_store); each replica's encoder host tier takes what it
        fetches (encoder_cache_host_bytes, the same size unless engine_options set it)."""
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ConfigError(f"num_replicas must be a positive int, got {num_replicas!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        self.model = str(model)
        self.encoder_store = None
        self._config: ReplicaConfig | None = None  # after a reconfigure: sent with every sub-batch
        self._configure(engine_options, lora_modules, encoder_store_bytes)
        self.batch_size = batch_size
        if num_cpus is None:
            num_cpus = 1
        threads = None if num_gpus else max(1, math.floor(num_cpus))
        actor_class = ray.remote(EngineReplica).options(
            num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=max_restarts, max_task_retries=max_task_retries
        )
        self.replicas = [
            actor_class.remote(self.model, self.engine_options, i, threads, self.lora_modules, self.encoder_store)
            for i in range(num_replicas)
        ]
        self.alive = [True] * num_replicas
        ray.get([r.ready.remote() for r in self.replicas])  # surfaces a bad checkpoint or option now
        self._keys: SharingKeys | None = None
        self._sticky: dict[str, int] = {}  # sharing key -> the replica whose caches hold its state

    def _configure(self, engine_options: dict[str, Any] | None, lora_modules: dict[str, str] | None,
                   encoder_store_bytes: int) -> None:
        """Checks and takes the replicas' engine options, adapters and store. The store is kept when its size and the
        engine options stay (what it holds is what the new engines would encode), else replaced."""
        if not isinstance(encoder_store_bytes, int) or encoder_store_bytes < 0:
            raise ConfigError(f"encoder_store_bytes must be an int >= 0, got {encoder_store_bytes!r}")
        options = dict(engine_options or {})
        if encoder_store_bytes:
            if options.get("encoder_cache_host_bytes") == 0:
                raise ConfigError("encoder_store_bytes needs the replicas' encoder host tier: encoder_cache_host_bytes must not be 0")
            options.setdefault("encoder_cache_host_bytes", encoder_store_bytes)
        if self.encoder_store is not None and (encoder_store_bytes, options) != (self.encoder_store_bytes, self.engine_options):
            ray.kill(self.encoder_store)
            self.encoder_store = None
        if encoder_store_bytes and self.encoder_store is None:
            from mmengine.ray.encoder_store import create_store

            self.encoder_store = create_store(encoder_store_bytes)
        self.engine_options, self.lora_modules, self.encoder_store_bytes = options, dict(lora_modules or {}), encoder_store_bytes

    def reconfigure(self, engine_options: dict[str, Any] | None = None, lora_modules: dict[str, str] | None = None,
                    encoder_store_bytes: int = 0) -> None:
        """Fresh engines with other options, adapters and encoder store (as the constructor takes them) on the live
        replicas, in the actors they run in: another job on the same model without the replicas' start-up (each a
        process importing torch, transformers and the model code: seconds of CPU a replica). A store of the same
        size is kept, with what it holds, when the engine options stay. A replica that Ray restarts later (it comes
        back with the constructor's options) takes these with its next sub-batch."""
        self._configure(engine_options, lora_modules, encoder_store_bytes)
        version = self._config.version + 1 if self._config is not None else 1
        self._config = ReplicaConfig(version, self.engine_options, self.lora_modules, self.encoder_store)
        ray.get([r.reconfigure.remote(self._config) for i, r in enumerate(self.replicas) if self.alive[i]])
        self._keys = None  # block_size, the hash algorithm: the sharing keys follow the engines' options
        self._sticky.clear()

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def sharing_keys(self, prompts: Sequence[str], images: Sequence[Any]) -> list[str | None]:
        if self._keys is None:
            self._keys = SharingKeys(
                self.model,
                block_size=self.engine_options.get("block_size", 16),
                hash_algo=self.engine_options.get("prefix_caching_hash_algo", "xxh3_128"),
            )
        return self._keys.keys(prompts, images)

    def run(
        self,
        ds: Any,
        affinity: str | None = "prefix+image",
        progress: ProgressHook | None = None,
        window_rows: int | None = None,
    ) -> BatchResult:
        """Answers every row of `ds`. With `window_rows`, the driver holds one window of rows at a time
        (keys, placement and dispatch per window); a key keeps its replica from window to window."""
        if affinity not in AFFINITIES:
            raise ConfigError(f"affinity must be one of {AFFINITIES}, got {affinity!r}")
        if window_rows is not None and (not isinstance(window_rows, int) or window_rows < 1):
            raise ConfigError(f"window_rows must be a positive int or None, got {window_rows!r}")
        windows = [ds.take_all()] if window_rows is None else _windows(ds, window_rows)
        parts, placed, retried, offset = [], [[] for _ in range(self.num_replicas)], 0, 0
        for rows in windows:
            if not rows:
                continue
            check_columns(list(rows[0]))
            placement = self._place(rows, affinity)
            outputs, window_retried = self._dispatch(rows, placement, progress)
            # blocks of a sub-batch's rows: from_items' default is a block (an Arrow table, an object-store put) per row
            # up to 200, and every later pass over the result (take_all, map_batches) walks each block
            parts.append(ray.data.from_items([{**rows[i], **outputs[i]} for i in range(len(rows))],
                                             override_num_blocks=math.ceil(len(rows) / self.batch_size)))
            for replica, replica_rows in enumerate(placement.rows):
                placed[replica].extend(offset + i for i in replica_rows)
            retried += window_retried
            offset += len(rows)
        if len(parts) == 1:
            dataset = parts[0]  # from_items' dataset is materialized already
        else:
            dataset = (parts[0].union(*parts[1:]) if parts else ds).materialize()
        if self.encoder_store is not None:  # what this run encoded is in the store before the next run asks
            ray.get([r.flush_encoder_store.remote() for i, r in enumerate(self.replicas) if self.alive[i]])
        return BatchResult(dataset, self.stats(), Placement(tuple(tuple(r) for r in placed)), retried)

    def _place(self, rows: list[dict[str, Any]], affinity: str | None) -> Placement:
        """Placement over the live replicas; keys stick to the replica that took them before."""
        live = [r for r in range(self.num_replicas) if self.alive[r]]
        if not live:
            raise RuntimeError("every replica died; no rows can be answered")
        if affinity is None:
            local = place_rows([None] * len(rows), len(live), affinity=False)
        else:
            keys = self.sharing_keys([r["prompt"] for r in rows], [r.get("images") for r in rows])
            keys = [with_adapter(key, row.get("lora") or None) for key, row in zip(keys, rows)]
            index_of = {replica: i for i, replica in enumerate(live)}
            preferred = {k: index_of[r] for k, r in self._sticky.items() if r in index_of}
            local = place_rows(keys, len(live), affinity=True, preferred=preferred)
            for i, local_rows in enumerate(local.rows):
                for row in local_rows:
                    if keys[row] is not None:
                        self._sticky.setdefault(keys[row], live[i])
        placed: list[tuple[int, ...]] = [() for _ in range(self.num_replicas)]
        for i, local_rows in enumerate(local.rows):
            placed[live[i]] = local_rows
        return Placement(tuple(placed))

    def _dispatch(
        self, rows: list[dict[str, Any]], placement: Placement, progress: ProgressHook | None
    ) -> tuple[dict[int, dict[str, Any]], int]:
        pending: dict[Any, tuple[int, tuple[int, ...]]] = {}  # object ref -> (replica, row indices)

        def submit(replica: int, chunk: tuple[int, ...]) -> None:
            ref = self.replicas[replica].generate.remote([rows[i] for i in chunk], self._config)
            pending[ref] = (replica, chunk)

        for replica, replica_rows in enumerate(placement.rows):
            for start in range(0, len(replica_rows), self.batch_size):
                submit(replica, replica_rows[start : start + self.batch_size])
        outputs: dict[int, dict[str, Any]] = {}
        done_per_replica = [0] * self.num_replicas
        takeover: dict[int, int] = {}  # dead replica -> the live replica that took its rows
        retried = 0
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            replica, chunk = pending.pop(ref)
            try:
                answers = ray.get(ref)
            except (ActorDiedError, ActorUnavailableError, RayActorError):
                self.alive[replica] = False
                live = [r for r in range(self.num_replicas) if self.alive[r]]
                if not live:
                    raise RuntimeError("every replica died; no rows can be finished") from None
                if replica not in takeover or not self.alive[takeover[replica]]:
                    takeover[replica] = min(live, key=lambda r: sum(len(c) for rr, c in pending.values() if rr == r))
                retried += len(chunk)
                submit(takeover[replica], chunk)
                continue
            for row, answer in zip(chunk, answers, strict=True):
                outputs.setdefault(row, answer)  # a row answered twice is kept once
            done_per_replica[replica] += len(chunk)
            if progress is not None:
                progress(self, replica, done_per_replica[replica])
        missing = sorted(set(range(len(rows))) - set(outputs))
        if missing:
            raise RuntimeError(f"rows {missing[:10]} got no output")
        return outputs, retried

    def stats(self) -> list[dict[str, int] | None]:
        refs = [r.stats.remote() if self.alive[i] else None for i, r in enumerate(self.replicas)]
        return [ray.get(ref) if ref is not None else None for ref in refs]

    def reset(self) -> None:
        """Fresh engines (empty caches, zeroed counters) on every live replica."""
        ray.get([r.reset.remote() for i, r in enumerate(self.replicas) if self.alive[i]])
        self._sticky.clear()

    def store_stats(self) -> dict[str, int] | None:
        """The cluster-wide encoder store's counts (None without one)."""
        return ray.get(self.encoder_store.stats.remote()) if self.encoder_store is not None else None

    def shutdown(self) -> None:
        for replica in self.replicas:
            ray.kill(replica)
        if self.encoder_store is not None:
            ray.kill(self.encoder_store)
            self.encoder_store = None
        self.replicas = []
        self.alive = []

    def __enter__(self) -> BatchRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def run_batch(
    ds: Any,
    model: str | os.PathLike,
    num_replicas: int = 1,
    engine_options: dict[str, Any] | None = None,
    affinity: str | None = "prefix+image",
    num_gpus: float = 0,
    num_cpus: float | None = None,
    batch_size: int = 64,
    lora_modules: dict[str, str] | None = None,
    encoder_store_bytes: int = 0,
) -> BatchResult:
    """Runs every row of `ds` through `num_replicas` engine replicas and returns the materialized
    outputs (input columns + text, token_ids, finish_reason, num_cached_tokens, replica) and each
    replica's engine stats. The replicas are shut down afterwards; keep a BatchRunner to reuse them."""
    with BatchRunner(model, num_replicas, engine_options, num_gpus, num_cpus, batch_size, lora_modules=lora_modules,
                     encoder_store_bytes=encoder_store_bytes) as runner:
        return runner.run(ds, affinity)


def _windows(ds: Any, size: int) -> Iterator[list[dict[str, Any]]]:
    """The dataset's rows, `size` at a time, from one streaming pass."""
    for batch in ds.iter_batches(batch_size=size, batch_format="pyarrow"):
        yield batch.to_pylist()
