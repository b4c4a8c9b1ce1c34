"""The encoder cache: a vision encoder's output computed once per item, shared across requests.

  hashing.py    content hashes of items: the same picture, processed the same way, hashes the same
  manager.py    EncoderCacheManager: the books, keyed by mm_hash (references, pins, hits and misses)
  budget.py     the autotuned encoder budget: embeddings per step and the cache's capacity
  host_tier.py  encoder outputs evicted from the device, kept in (pinned) host memory
"""
