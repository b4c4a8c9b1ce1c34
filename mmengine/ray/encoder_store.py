"""A cluster-wide store of encoder outputs for engine replicas on Ray.

Replicas publish each output they compute to the Ray object store under the item's content hash (the
hash is the same on every replica for the same bytes and model) and register it with one `EncoderStore`
actor, which keeps the references LRU within a byte budget. A replica about to queue prompts asks the
store for the items its own caches lack and fetches the ones it has into its encoder host tier, so
the scheduler copies them in instead of running the tower. Affinity routing stays the first line; the
store covers fallback routing, new replicas and restarts.

Objects belong to the replica that put them: when it dies they are gone, and a fetch that fails or
times out simply leaves the item to be encoded (never a wrong or missing result).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Any

import ray

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0


class EncoderStore:
    """The store's books (a Ray actor's body): mm_hash -> the object holding its output, LRU by bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, tuple[list[Any], int]] = OrderedDict()
        self.num_bytes = 0
        self.counts = {"published": 0, "lookups": 0, "found": 0, "evictions": 0}

    def publish(self, mm_hash: str, ref: list[Any], num_bytes: int) -> None:
        """`ref` is [ObjectRef] (a list, so Ray hands the reference over rather than the tensor)."""
        if mm_hash in self._entries or num_bytes > self.capacity_bytes:
            return
        while self.num_bytes + num_bytes > self.capacity_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self.num_bytes -= size
            self.counts["evictions"] += 1
        self._entries[mm_hash] = (ref, num_bytes)
        self.num_bytes += num_bytes
        self.counts["published"] += 1

    def lookup(self, mm_hashes: list[str]) -> dict[str, list[Any]]:
        self.counts["lookups"] += len(mm_hashes)
        found = {}
        for mm_hash in mm_hashes:
            entry = self._entries.get(mm_hash)
            if entry is not None:
                self._entries.move_to_end(mm_hash)
                found[mm_hash] = entry[0]
        self.counts["found"] += len(found)
        return found

    def stats(self) -> dict[str, int]:
        return {**self.counts, "entries": len(self._entries), "bytes": self.num_bytes}


def create_store(capacity_bytes: int) -> Any:
    """The store actor (no CPU of its own: it only keeps books)."""
    return ray.remote(EncoderStore).options(num_cpus=0).remote(capacity_bytes)


def named_store(name: str, capacity_bytes: int) -> Any:
    """The store actor called `name`, made by the first replica that asks (detached: it outlives
    any one replica; Ray Serve's replicas find it by name)."""
    return ray.remote(EncoderStore).options(name=name, get_if_exists=True, lifetime="detached", num_cpus=0).remote(capacity_bytes)


class EncoderStoreClient:
    """A replica's side: publishes what its engine encodes (from a background thread, so a device
    output's copy to host never holds up a step) and fills its host tier from the store before prompts
    are queued."""

    def __init__(self, store: Any, engine: Any) -> None:
        if engine.encoder_host_tier is None:
            raise ValueError("the encoder store fills the encoder cache's host tier: set encoder_cache_host_bytes > 0")
        self.store = store
        self.engine = engine
        self.counts = {"encoder_store_fetches": 0, "encoder_store_fetch_failures": 0, "encoder_store_published": 0}
        self._outbox: queue.Queue = queue.Queue()
        self._publisher = threading.Thread(target=self._publish_loop, daemon=True, name="mmengine-encoder-store")
        self._publisher.start()
        engine.runner.on_encoded = self._outbox.put_nowait  # (mm_hash, output) after each tower run
        engine.before_enqueue = self.prefetch

    def _publish_loop(self) -> None:
        while True:
            entry = self._outbox.get()
            if entry is None:  # close()
                self._outbox.task_done()
                return
            mm_hash, output = entry
            try:
                host = output.detach().to("cpu")
                ray.get(self.store.publish.remote(mm_hash, [ray.put(host)], host.numel() * host.element_size()),
                        timeout=FETCH_TIMEOUT_S)
                self.counts["encoder_store_published"] += 1
            except Exception:  # noqa: BLE001 - a lost publication only costs another replica an encode
                logger.warning("could not publish encoder output %s", mm_hash, exc_info=True)
            finally:
                self._outbox.task_done()

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Waits until every output encoded so far is in the store (or failed to get there); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._outbox.all_tasks_done:
            while self._outbox.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._outbox.all_tasks_done.wait(remaining)
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        """Publishes what is queued, then stops the publisher thread and unhooks the engine: the thread held this
        client and so the engine, which a replica replacing its engine (reset, reconfigure) would never free."""
        if self.engine.runner.on_encoded == self._outbox.put_nowait:
            self.engine.runner.on_encoded = None
        if self.engine.before_enqueue == self.prefetch:
            self.engine.before_enqueue = None
        self._outbox.put_nowait(None)
        self._publisher.join(timeout_s)

    def prefetch(self, prompts: list[Any]) -> None:
        """Fetches the prompts' items that neither this engine's caches nor its host tier hold, when the
        store has them."""
        engine = self.engine
        with engine.lock:
            missing = sorted({item.mm_hash for prompt in prompts for item in prompt.mm_items
                              if item.mm_hash not in engine.encoder_cache and not engine.encoder_host_tier.holds(item.mm_hash)})
        if not missing:
            return
        try:
            found = ray.get(self.store.lookup.remote(missing), timeout=FETCH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the store is an optimization: without it, items are encoded
            logger.warning("encoder store lookup failed", exc_info=True)
            self.counts["encoder_store_fetch_failures"] += len(missing)
            return
        for mm_hash, (ref,) in found.items():
            try:
                output = ray.get(ref, timeout=FETCH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - its owner died or the fetch timed out: encode it
                self.counts["encoder_store_fetch_failures"] += 1
                continue
            with engine.lock:
                engine.encoder_host_tier.store(mm_hash, output)
            self.counts["encoder_store_fetches"] += 1
