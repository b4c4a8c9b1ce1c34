"""The paged KV cache and its prefix cache.

  block_hash.py  chained content hashes of full blocks (token ids, items, LoRA, salt), verified on lookup
  block_pool.py  BlockPool: physical blocks, reference counts, the LRU free queue, the prefix cache
  manager.py     KVCacheManager: which blocks each request holds, what is cached, what more can be had; pins
  host_tier.py   full blocks evicted from the device, kept in (pinned) host memory
  recurrent_state.py  hybrid models: a live state slot per running request, sparse state checkpoints for hits
  sliding_window.py  sliding-window layers' own pool: blocks that left the window go back, hits need only the window
  chunked_attention.py  chunked-attention layers (Llama 4): the same pool with the chunk's rule (blocks before the current chunk go back)
  coordinator.py CacheCoordinator: one prefix hit across the cache groups (attention blocks, windows, recurrent states)
"""
