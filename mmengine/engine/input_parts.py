"""The intake's start-up: a checkpoint's config, family, context length and InputProcessor, built without the model.

An engine builds these first (startup.py goes on to the model and the caches); a front end over an engine-core
process builds only these, so this module imports no model code (runner, layers, kernels, a family's model): a
front end pays for what it uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import GenerationConfig, PretrainedConfig

from mmengine.config import EngineConfig
from mmengine.errors import CheckpointError, ConfigError
from mmengine.models.family import ModelFamily
from mmengine.models.quantization import WeightQuantization, quantization_of
from mmengine.models.registry import family_class_for, load_family, load_hf_config, load_hf_processor
from mmengine.multimodal.preprocess_pool import PreprocessPool
from mmengine.multimodal.processor import InputProcessor

logger = logging.getLogger(__name__)


@dataclass
class InputParts:
    """What an engine's intake needs, built without the model: the checkpoint's config and family, the
    context length and the InputProcessor (tokenizer, processor, and its preprocessing workers)."""

    hf_config: PretrainedConfig
    family: ModelFamily
    max_model_len: int
    input_processor: InputProcessor


def build_input_parts(config: EngineConfig) -> InputParts:
    """The intake's parts alone (no weights are read): an engine-core process's front end builds these,
    and build_engine_parts starts from them. The processor's KV-cache and per-item limits are set once
    the model has sized its caches."""
    model_dir = Path(config.model)
    hf_config = load_hf_config(model_dir)
    family_class_for(hf_config)  # fail fast on unsupported architectures
    _check_quantization(config, quantization_of(hf_config))  # ... and quantization methods
    media = config.multimodal_config
    # a front end over an engine-core process takes the light processor (the core checks the full one's expansion)
    front_end = config.parallel_config.engine_core == "process"
    hf_processor = load_hf_processor(model_dir, media.mm_processor_kwargs, light=front_end)
    family = load_family(hf_config, hf_processor, model_dir)
    max_model_len = resolve_max_model_len(config, family)
    input_processor = InputProcessor(
        model_dir, family, max_model_len, media.limit_mm_per_prompt, media.max_image_pixels,
        media.mm_processor_cache_bytes, config.cache_config.prefix_caching_hash_algo, hf_processor=hf_processor,
        max_video_seconds=media.max_video_seconds, max_audio_seconds=media.max_audio_seconds,
        max_media_decode_seconds=media.max_media_decode_seconds,
    )
    if media.mm_processor_workers:  # they start while the model loads
        input_processor.pool = _preprocess_pool(config, input_processor)
    input_processor.pictures.warm_up()  # (the workers warm up their own)
    return InputParts(hf_config, family, max_model_len, input_processor)


def _preprocess_pool(config: EngineConfig, processor: InputProcessor) -> PreprocessPool:
    return PreprocessPool(processor.pictures.spec(), config.multimodal_config.mm_processor_workers)


def _check_quantization(config: EngineConfig, spec: WeightQuantization | None) -> None:
    """EngineConfig.quantization only asserts what the checkpoint's quantization_config says."""
    actual = "none" if spec is None else spec.method.removesuffix("-int4")
    if config.model_config.quantization is not None and config.model_config.quantization != actual:
        raise ConfigError(f"quantization={config.model_config.quantization!r}, but the checkpoint's quantization_config says {actual!r}")


def resolve_max_model_len(config: EngineConfig, family: ModelFamily) -> int:
    limit = family.text_config.max_position_embeddings
    window = family.sliding_window
    if config.model_config.max_model_len is not None:
        if config.model_config.max_model_len > limit:
            raise ConfigError(f"max_model_len={config.model_config.max_model_len} exceeds the model's max_position_embeddings={limit}")
        if window is not None and config.model_config.max_model_len > window:
            raise ConfigError(
                f"max_model_len={config.model_config.max_model_len} exceeds the model's sliding window ({window}); "
                "sliding-window attention is not supported, so max_model_len must stay within it"
            )
        return config.model_config.max_model_len
    if window is not None and window < limit:
        logger.warning("capping max_model_len to the model's sliding window (%d)", window)
        return window
    return limit


def eos_token_ids_of(model_dir: Path, hf_config: PretrainedConfig, tokenizer: Any) -> frozenset[int]:
    """The generation config's EOS ids (what transformers' generate() stops on), else the model's or tokenizer's."""
    value: Any = None
    path = model_dir / "generation_config.json"
    if path.exists():
        try:
            value = GenerationConfig.from_pretrained(str(model_dir), local_files_only=True).eos_token_id
        except Exception as err:  # transformers raises OSError or ValueError for a broken file
            raise CheckpointError(f"cannot read the generation config: {err}", path) from err
    if value is None:
        value = getattr(hf_config.text_config, "eos_token_id", None)
    if value is None:
        value = tokenizer.eos_token_id
    values = value if isinstance(value, list | tuple) else [value]
    return frozenset(v for v in values if isinstance(v, int))
