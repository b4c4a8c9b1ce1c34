"""Start-up: everything an engine is made of, built once and in order from an EngineConfig.

The order matters: the model and its processor first (they say how large an item can be), then the
runner (weights and activations on the device), then the KV cache from the memory left after the
encoder's share, then the caches' books and the scheduler over them. Nothing is patched afterwards.
The first part, the intake's (input_parts.py), is what a front end over an engine-core process builds alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from mmengine.config import EngineConfig
from mmengine.core.scheduler import Scheduler
from mmengine.encoder_cache.budget import EncoderBudget, compute_encoder_budget
from mmengine.encoder_cache.host_tier import EncoderHostTier, host_tier_bytes
from mmengine.encoder_cache.manager import EncoderCacheManager
from mmengine.engine.input_parts import build_input_parts, eos_token_ids_of
from mmengine.errors import ConfigError
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.host_tier import KVHostTier
from mmengine.kv_cache.manager import KVCacheManager
from mmengine.kv_cache.recurrent_state import RecurrentStateManager
from mmengine.kv_cache.chunked_attention import ChunkedAttentionManager, is_chunk
from mmengine.kv_cache.sliding_window import SlidingWindowManager
from mmengine.lora.adapter import DecoderShape, VisionTargets
from mmengine.lora.manager import LoRAManager
from mmengine.models.family import ModelFamily
from mmengine.models.loader import checkpoint_dtype
from mmengine.multimodal.processor import InputProcessor
from mmengine.runner import ModelRunner
from mmengine.runner.parallel_runner import ParallelRunner
from mmengine.sample.structured_output.grammar import GrammarCompiler
from mmengine.spec.draft_head import enable_draft_head
from mmengine.utils.host_memory import check_cpu_kv_cache_fits

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """The engine's components, as MMEngine exposes them."""

    config: EngineConfig
    hf_config: PretrainedConfig
    family: ModelFamily
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    input_processor: InputProcessor
    runner: ModelRunner
    encoder_budget: EncoderBudget
    kv_cache: KVCacheManager
    encoder_cache: EncoderCacheManager
    encoder_host_tier: EncoderHostTier | None
    scheduler: Scheduler
    eos_token_ids: frozenset[int]
    grammars: GrammarCompiler
    loras: LoRAManager | None


def build_engine_parts(config: EngineConfig) -> EngineParts:
    model_dir = Path(config.model)
    inputs = build_input_parts(config)
    hf_config, family, max_model_len, input_processor = inputs.hf_config, inputs.family, inputs.max_model_len, inputs.input_processor
    try:
        device = config.resolve_device()
        dtype = config.resolve_dtype(checkpoint_dtype(model_dir), device)
        return _build_rest(config, model_dir, hf_config, family, max_model_len, device, dtype, input_processor)
    except BaseException:
        if input_processor.pool is not None:
            input_processor.pool.close()
        raise


def _build_rest(config: EngineConfig, model_dir: Path, hf_config: Any, family: ModelFamily, max_model_len: int,
                device: Any, dtype: Any, input_processor: InputProcessor) -> EngineParts:
    enable_draft_head(config, family, model_dir)
    if config.parallel_config.tensor_parallel_size > 1:  # the model in worker processes, split over them
        runner = ParallelRunner(config, family, model_dir, device, dtype, max_model_len)
        try:
            return _build_books(config, model_dir, hf_config, family, max_model_len, device, dtype, input_processor, runner)
        except BaseException:
            runner.shutdown()
            raise
    runner = ModelRunner(config, family, model_dir, device, dtype, max_model_len)
    return _build_books(config, model_dir, hf_config, family, max_model_len, device, dtype, input_processor, runner)


def _build_books(config: EngineConfig, model_dir: Path, hf_config: Any, family: ModelFamily, max_model_len: int,
                 device: Any, dtype: Any, input_processor: InputProcessor, runner: ModelRunner | ParallelRunner) -> EngineParts:
    num_blocks = _start_runner(config, family, runner)
    encoder_budget = encoder_budget_for(config, family, runner, pinned_room_tokens=num_blocks * config.cache_config.block_size)
    kv_cache, encoder_cache, encoder_host_tier = _caches(config, runner, num_blocks, encoder_budget)
    input_processor.max_tokens_in_kv_cache = num_blocks * config.cache_config.block_size
    input_processor.max_tokens_per_item = encoder_budget.compute_budget_tokens
    spans = _check_whole_spans(config, family)
    scheduler = Scheduler(config, kv_cache, encoder_cache, encoder_budget.compute_budget_tokens, max_model_len, encoder_host_tier,
                          _recurrent_states(config, family, runner, kv_cache), spans, _window_blocks(config, runner))
    eos_token_ids = eos_token_ids_of(model_dir, hf_config, input_processor.tokenizer)
    grammars = GrammarCompiler(input_processor.tokenizer, family.text_config.vocab_size, eos_token_ids)
    logger.info("mmengine ready: %s on %s/%s, %d KV blocks of %d tokens%s, max_model_len %d",
                model_dir, device, dtype, num_blocks, config.cache_config.block_size,
                f" (and {runner.num_window_blocks} for the sliding-window layers)" if runner.window_pool else "", max_model_len)
    return EngineParts(config, hf_config, family, max_model_len, device, dtype, input_processor, runner, encoder_budget,
                       kv_cache, encoder_cache, encoder_host_tier, scheduler, eos_token_ids, grammars,
                       _lora_manager(config, family, runner))


def _check_whole_spans(config: EngineConfig, family: ModelFamily) -> frozenset[str]:
    """The modalities whose items a prefill chunk must hold whole (their tokens attend both ways); the
    token budget must then hold the largest such item."""
    modalities = family.bidirectional_modalities
    sizes = family.max_tokens_by_modality()
    largest = max((sizes.get(m, 0) for m in modalities), default=0)
    if largest > config.scheduler_config.max_num_batched_tokens:
        raise ConfigError(f"max_num_batched_tokens={config.scheduler_config.max_num_batched_tokens} cannot hold a whole picture of {largest} "
                          f"tokens, which {family.display_name} attends to both ways in one prefill chunk; raise it to "
                          f"at least {largest}")
    return modalities


def _start_runner(config: EngineConfig, family: ModelFamily, runner: ModelRunner) -> int:
    """Sizes and allocates the KV cache in the memory left after the encoder's working share, captures
    the CUDA graphs and warms the runner up; returns the number of KV blocks."""
    unpinned = encoder_budget_for(config, family, runner, pinned_room_tokens=0, warn=False)  # the real one warns
    images_per_step = unpinned.compute_budget_tokens // unpinned.max_tokens_per_item
    num_blocks = runner.determine_num_kv_blocks(
        encoder_fixed_bytes=unpinned.compute_budget_tokens * runner.embedding_bytes,
        encoder_bytes_per_block=config.cache_config.block_size * runner.embedding_bytes,
        images_per_step=images_per_step,
        encoder_budget_tokens=unpinned.compute_budget_tokens,
    )
    if getattr(runner, "worker_device", runner.device).type == "cpu":  # (a ParallelRunner's ranks may be on GPUs)
        per_block = runner.kv_block_bytes + config.cache_config.block_size * runner.embedding_bytes
        per_block += -(-runner.num_window_blocks * runner.window_block_bytes // num_blocks)  # the window pool's share
        check_cpu_kv_cache_fits(num_blocks, per_block, explicit=config.cache_config.num_kv_blocks is not None)
    runner.allocate_kv_cache(num_blocks)
    if runner.use_cuda_graphs:
        runner.capture_cuda_graphs()
    runner.warm_up(images_per_step)
    return num_blocks


def encoder_budget_for(config: EngineConfig, family: ModelFamily, runner: ModelRunner, pinned_room_tokens: int,
                       warn: bool = True) -> EncoderBudget:
    return compute_encoder_budget(
        family.max_tokens_per_item(config.multimodal_config.limit_mm_per_prompt, config.multimodal_config.max_audio_seconds),
        config.scheduler_config.max_num_batched_tokens,
        config.scheduler_config.max_num_seqs,
        config.multimodal_config.limit_mm_per_prompt,
        pinned_room_tokens=pinned_room_tokens,
        bytes_per_token=runner.embedding_bytes,
        encoder_cache_size=config.cache_config.encoder_cache_size,
        warn=warn,
        items_per_video=family.max_items_per_video,
        items_per_image=family.max_items_per_image,
    )


def _caches(config: EngineConfig, runner: ModelRunner, num_blocks: int,
            budget: EncoderBudget) -> tuple[KVCacheManager, EncoderCacheManager, EncoderHostTier | None]:
    """The KV cache's and the encoder cache's books, joined by the one path they talk through (pins),
    and the encoder cache's host tier (sized by encoder_cache_host_bytes; None: see EngineConfig)."""
    kv_host_bytes = host_tier_bytes(config.cache_config.kv_cache_host_bytes, runner.device.type)
    kv_cache = KVCacheManager(
        num_blocks,
        config.cache_config.block_size,
        make_hash_function(config.cache_config.prefix_caching_hash_algo, config.cache_config.prefix_caching_hash_seed),
        enable_prefix_caching=config.cache_config.enable_prefix_caching,
        host_tier=KVHostTier(kv_host_bytes, runner.kv_block_bytes) if kv_host_bytes else None,
        pin_overlapping_items=runner.family.recurrent_shape is not None,
    )
    encoder_cache = EncoderCacheManager(budget.cache_capacity_tokens, kv_cache.uncache_pinning)
    kv_cache.pin_listener = encoder_cache
    encoder_host_bytes = host_tier_bytes(config.cache_config.encoder_cache_host_bytes, runner.device.type)
    encoder_host_tier = EncoderHostTier(encoder_host_bytes) if encoder_host_bytes > 0 else None
    runner.encoder_host_tier = encoder_host_tier
    return kv_cache, encoder_cache, encoder_host_tier


def _recurrent_states(config: EngineConfig, family: ModelFamily, runner: ModelRunner,
                      kv_cache: KVCacheManager) -> RecurrentStateManager | None:
    """A hybrid model's recurrent-state books, told when a block a checkpoint marks leaves the KV cache."""
    if family.recurrent_shape is None:
        return None
    states = RecurrentStateManager(config.scheduler_config.max_num_seqs, runner.num_state_checkpoints, config.cache_config.block_size,
                                   is_block_cached=kv_cache.pool.is_hash_cached,
                                   num_draft_slots=config.spec_config.num_speculative_tokens)
    kv_cache.on_block_uncached = states.drop
    return states


def _window_blocks(config: EngineConfig, runner: ModelRunner) -> SlidingWindowManager | None:
    """The books of the sliding-window (or chunked-attention) layers' pool, when the model has one."""
    pool = runner.window_pool
    if pool is None:
        return None
    manager = ChunkedAttentionManager if is_chunk(pool.window) else SlidingWindowManager  # the span's rule
    return manager(runner.num_window_blocks, config.cache_config.block_size, pool.window, config.cache_config.enable_prefix_caching)


def _lora_manager(config: EngineConfig, family: ModelFamily, runner: ModelRunner) -> LoRAManager | None:
    if not config.lora_config.enable_lora:
        return None
    shape = DecoderShape.of(family.text_config, family.head_dim)
    vision = VisionTargets({name: (m.in_features, m.out_features) for name, m in runner.vision_lora_modules.items()},
                           runner.model.checkpoint_name, runner.model.is_ignorable)
    return LoRAManager(shape, config.lora_config.max_loras, config.lora_config.max_lora_rank, config.lora_config.max_cpu_loras, vision)
