"""The counters MMEngine.stats() reports: the step loop's work, each cache's own books, the tiers, LoRA."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmengine.encoder_cache.host_tier import EncoderHostTier
from mmengine.kv_cache.host_tier import KVHostTier
from mmengine.kv_cache.recurrent_state import RecurrentStateManager
from mmengine.kv_cache.sliding_window import SlidingWindowManager
from mmengine.multimodal.processor import InputProcessor

if TYPE_CHECKING:
    from mmengine.engine.startup import EngineParts
    from mmengine.engine.step_loop import StepLoop


def engine_stats(parts: EngineParts, steps: StepLoop) -> dict[str, int]:
    """Every counter, read under the engine's lock."""
    runner, encoder_cache, kv_cache, scheduler = parts.runner, parts.encoder_cache, parts.kv_cache, parts.scheduler
    processor = parts.input_processor
    return {
        **steps.counters,
        **scheduler.spec.stats(),
        # decode steps a request made without drafts, its drafts having been rejected step after step (spec/backoff.py)
        **({"spec_backoff_steps": steps.drafts.backoff.num_paused_steps} if steps.drafts.backoff is not None else {}),
        "num_preemptions": scheduler.num_preemptions,
        "encoder_runs": runner.num_encoder_runs,
        "cascade_steps": runner.num_cascade_steps,
        "cascade_groups": runner.num_cascade_groups,
        "cascade_tokens": runner.num_cascade_tokens,
        "encoder_cache_hits": encoder_cache.num_hits,
        "encoder_cache_misses": encoder_cache.num_misses,
        "encoder_cache_evictions": encoder_cache.num_evictions,
        "encoder_cache_pinned": encoder_cache.num_pinned,
        "encoder_cache_entries": len(encoder_cache.entries),
        "encoder_cache_bytes": encoder_cache.num_used * runner.embedding_bytes,
        **_encoder_host_tier_stats(parts.encoder_host_tier),
        **_kv_host_tier_stats(kv_cache.host_tier),
        "reencodes_after_prefix_hit": scheduler.num_reencodes_after_prefix_hit,
        **processor_stats(processor),
        "prefix_cache_queries": kv_cache.prefix_cache_queries,
        "prefix_cache_hits": kv_cache.prefix_cache_hits,
        "kv_blocks_total": kv_cache.num_blocks,
        "kv_blocks_free": kv_cache.num_free_blocks,
        "kv_blocks_cached": kv_cache.num_cached_blocks,
        "kv_blocks_evicted": kv_cache.pool.num_evictions,
        **_window_stats(scheduler.caches.windows),
        "requests_running": len(scheduler.running),
        "requests_waiting": len(scheduler.waiting),
        "encoder_cache_referenced": encoder_cache.num_referenced,
        **_state_stats(scheduler.states, runner.state_slot_bytes),
        **scheduler.sharing.stats(),
        **(parts.loras.stats() if parts.loras is not None else {}),
    }


def processor_stats(processor: InputProcessor) -> dict[str, int]:
    """The intake's counters (an engine-core process's front end reports its own)."""
    return {
        "images_decoded": processor.num_images_decoded,
        "images_preprocessed": processor.num_images_preprocessed,
        "videos_decoded": processor.videos.num_videos_decoded,
        "videos_preprocessed": processor.videos.num_videos_preprocessed,
        "audios_decoded": processor.audios.num_audios_decoded if processor.audios is not None else 0,
        "audios_preprocessed": processor.audios.num_audios_preprocessed if processor.audios is not None else 0,
        "mm_processor_cache_hits": processor.cache.num_hits,
        "mm_processor_cache_bytes": processor.cache.num_bytes,
    }


def _encoder_host_tier_stats(tier: EncoderHostTier | None) -> dict[str, int]:
    if tier is None:
        return {name: 0 for name in ("encoder_host_hits", "encoder_host_entries", "encoder_host_bytes", "encoder_host_stored",
                                     "encoder_host_evictions", "encoder_host_bytes_copied_in", "encoder_host_bytes_copied_out")}
    return {"encoder_host_hits": tier.num_hits, "encoder_host_entries": len(tier), "encoder_host_bytes": tier.num_bytes,
            "encoder_host_stored": tier.num_stored, "encoder_host_evictions": tier.num_evictions,
            "encoder_host_bytes_copied_in": tier.bytes_in, "encoder_host_bytes_copied_out": tier.bytes_out}


def _kv_host_tier_stats(tier: KVHostTier | None) -> dict[str, int]:
    if tier is None:
        return {name: 0 for name in ("kv_host_hits", "kv_host_blocks", "kv_host_bytes", "kv_host_stored", "kv_host_evictions")}
    return {"kv_host_hits": tier.num_hits, "kv_host_blocks": len(tier), "kv_host_bytes": tier.num_bytes,
            "kv_host_stored": tier.num_stored, "kv_host_evictions": tier.num_evictions}


def _window_stats(windows: SlidingWindowManager | None) -> dict[str, int]:
    """The sliding-window layers' pool (zeros without one): its blocks, and those given back mid-request."""
    if windows is None:
        return {name: 0 for name in ("kv_window_blocks_total", "kv_window_blocks_free", "kv_window_blocks_cached",
                                     "kv_window_blocks_freed", "kv_window_blocks_evicted")}
    return {"kv_window_blocks_total": windows.num_blocks, "kv_window_blocks_free": windows.num_free_blocks,
            "kv_window_blocks_cached": windows.pool.num_cached_blocks, "kv_window_blocks_freed": windows.num_freed_out_of_window,
            "kv_window_blocks_evicted": windows.pool.num_evictions}


def _state_stats(states: RecurrentStateManager | None, slot_bytes: int) -> dict[str, int]:
    """Hybrid models' recurrent-state checkpoints (zeros for attention-only models)."""
    if states is None:
        return {name: 0 for name in ("state_checkpoints_total", "state_checkpoints_cached", "state_checkpoints_saved",
                                     "state_checkpoint_hits", "state_checkpoints_evicted", "state_checkpoint_bytes")}
    return {"state_checkpoints_total": states.num_checkpoints, "state_checkpoints_cached": states.num_cached_checkpoints,
            "state_checkpoints_saved": states.checkpoints_saved, "state_checkpoint_hits": states.checkpoint_hits,
            "state_checkpoints_evicted": states.checkpoints_evicted, "state_checkpoint_bytes": slot_bytes}
