"""What a video's or an audio clip's loader holds: the processor's cache and its lock, the keys an item's
hash is taken under (the checkpoint's fingerprint, the processor's settings, the algorithm), and the
modality's limits."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from mmengine.models.family import ModelFamily
from mmengine.multimodal.processor_cache import ProcessorCache

Limits = TypeVar("Limits")


class MediaLoader(Generic[Limits]):
    def __init__(
        self, family: ModelFamily, cache: ProcessorCache, cache_lock: threading.Lock, fingerprint: str, settings_key: str,
        limits: Limits, hash_algo: str,
    ) -> None:
        self.family = family
        self.cache = cache
        self._cache_lock = cache_lock  # the processor's: guards `cache`
        self.fingerprint = fingerprint
        self.settings_key = settings_key
        self.limits = limits
        self.hash_algo = hash_algo
