"""How the cache memory is shared out: the sliding-window pool's plan, a hybrid model's recurrent states, the KV blocks.

It owns the arithmetic of start-up sizing, from bytes already measured (a GPU's profiling run, or the CPU's
configured cpu_kv_cache_bytes): whether sliding-window layers get a pool of their own, what a hybrid model's live
states, draft states and prefix checkpoints take first, and how many full-attention and sliding-window blocks the rest
holds (num_kv_blocks caps it on a GPU and sets it on the CPU), with a ConfigError when nothing is left. The runner
measures and allocates; these are functions over plain arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from mmengine.config import CacheConfig
from mmengine.errors import ConfigError
from mmengine.runner.kv_tensors import WindowPool, split_kv_memory

logger = logging.getLogger(__name__)


def plan_window_pool(windows: Sequence[int | None], cache_config: CacheConfig, block_size: int,
                     max_num_batched_tokens: int, max_model_len: int) -> WindowPool | None:
    """The sliding-window layers' pool, when they have one window shorter than max_model_len (and the
    config does not keep every token's K/V everywhere). `windows`: each cached layer's (None: full attention)."""
    distinct = {w for w in windows if w is not None}
    if cache_config.sliding_kv_ratio is None or len(distinct) != 1 or min(distinct) >= max_model_len:
        if len(distinct) > 1:
            logger.info("sliding windows of %s tokens: every cached layer keeps every token", sorted(distinct))
        return None
    return WindowPool.plan(min(distinct), cache_config.sliding_kv_ratio, block_size, max_num_batched_tokens, max_model_len)


def reserve_state_memory(available: int, slot_bytes: int, live_slots: int, cache_config: CacheConfig) -> tuple[int, int]:
    """Hybrid models: takes the `live_slots` states (live, draft and scratch) and the checkpoints out of
    `available` (cache memory); returns (what is left for the KV cache, the number of checkpoints)."""
    if slot_bytes == 0:
        return available, 0
    available -= live_slots * slot_bytes
    if not cache_config.enable_prefix_caching:
        checkpoints = 0
    elif cache_config.num_state_checkpoints is not None:
        checkpoints = cache_config.num_state_checkpoints
    else:
        checkpoints = max(0, int(available * cache_config.state_checkpoint_memory_fraction) // slot_bytes)
    return available - checkpoints * slot_bytes, checkpoints


def fit_kv_blocks(available: int, encoder_fixed_bytes: int, per_block: int, window_block_bytes: int,
                  pool: WindowPool | None, useful_blocks: int, num_kv_blocks: int | None, cuda: bool) -> tuple[int, int]:
    """(full-attention blocks, sliding-window blocks) for `available` bytes less the encoder cache's fixed part,
    `per_block` bytes a full-attention block (its share of the encoder cache's pinned room included).
    `num_kv_blocks` (the config's): on a GPU a cap within the memory; on the CPU the count."""
    num_blocks, num_window_blocks = split_kv_memory(available - encoder_fixed_bytes, per_block, window_block_bytes,
                                                    pool, useful_blocks)
    if num_kv_blocks is not None:
        num_blocks = min(num_blocks, num_kv_blocks) if cuda else num_kv_blocks
        if pool is not None:
            wanted = pool.blocks_for(num_blocks)
            num_window_blocks = min(num_window_blocks, wanted) if cuda else wanted
    if num_blocks < 1 or (pool is not None and num_window_blocks < pool.min_blocks):
        raise ConfigError(
            f"no memory left for the KV cache ({available} bytes available, {encoder_fixed_bytes} for the encoder "
            f"cache, {per_block} bytes per block"
            + (f", {pool.min_blocks} sliding-window blocks of {window_block_bytes} bytes at least)"
               if pool is not None else ")")
        )
    return int(num_blocks), num_window_blocks
