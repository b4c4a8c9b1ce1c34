"""Preprocessed items kept across requests, so a picture seen before is not decoded, resized and
normalized again.

Two maps:
- mm_hash -> preprocessed item (its encoder inputs and token count): an LRU bounded in bytes, plus
  weak references to every item a live request still holds (so queued requests share one copy even
  past the LRU's capacity);
- digest of encoded input (file or bytes) -> mm_hash: a repeated file skips decoding too, since
  the content hash is over decoded pixels. Bounded in entries (a few hundred bytes each).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

from mmengine.models.family import EncoderInputs

MAX_ENCODED_ENTRIES = 1 << 16


class ProcessorCache:
    def __init__(self, capacity_bytes: int, max_encoded_entries: int = MAX_ENCODED_ENTRIES) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_encoded_entries = max_encoded_entries
        self._lru: OrderedDict[str, EncoderInputs] = OrderedDict()
        self._alive: weakref.WeakValueDictionary[str, EncoderInputs] = weakref.WeakValueDictionary()
        self._encoded: OrderedDict[str, str] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def get(self, mm_hash: str) -> EncoderInputs | None:
        """The preprocessed item if it is cached or held by a live request; counts a hit or a miss."""
        tensor = self._lru.get(mm_hash)
        if tensor is not None:
            self._lru.move_to_end(mm_hash)
        else:
            tensor = self._alive.get(mm_hash)
            if tensor is not None:
                self._insert(mm_hash, tensor)
        if tensor is None:
            self.num_misses += 1
        else:
            self.num_hits += 1
        return tensor

    def put(self, mm_hash: str, tensor: EncoderInputs) -> EncoderInputs:
        """Stores a freshly preprocessed item; returns the one to use (an equal one already held wins)."""
        held = self._alive.setdefault(mm_hash, tensor)
        self._insert(mm_hash, held)
        return held

    def hash_of_encoded(self, digest: str) -> str | None:
        mm_hash = self._encoded.get(digest)
        if mm_hash is not None:
            self._encoded.move_to_end(digest)
        return mm_hash

    def remember_encoded(self, digest: str, mm_hash: str) -> None:
        self._encoded[digest] = mm_hash
        self._encoded.move_to_end(digest)
        while len(self._encoded) > self.max_encoded_entries:
            self._encoded.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()
        self._encoded.clear()
        self.num_bytes = 0

    def _insert(self, mm_hash: str, tensor: EncoderInputs) -> None:
        size = tensor.nbytes
        if size > self.capacity_bytes or mm_hash in self._lru:
            return
        self._lru[mm_hash] = tensor
        self.num_bytes += size
        while self.num_bytes > self.capacity_bytes:
            _, evicted = self._lru.popitem(last=False)
            self.num_bytes -= evicted.nbytes
