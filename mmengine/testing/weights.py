"""Random-weight models built with transformers' own classes and initialization, saved as safetensors."""

from __future__ import annotations

import os
import pathlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

# The weight scale of the real models (and transformers' default): what benchmark checkpoints use.
REAL_INITIALIZER_RANGE = 0.02

# The tiny checkpoints' weight scale. At 0.02 the residual stream is dominated by the current token's embedding:
# tied-embedding models greedily repeat one token whatever the image or prompt, and untied ones have top-2 logit
# gaps down to ~1e-4. 0.1 is still mostly repetition when tied. At 0.2 greedy output depends on image and prompt
# (LLaVA: 12/12 distinct 16-token outputs for 6 images x 2 prompts, median top-2 gap ~0.3, 5th percentile ~2e-2;
# Qwen2-VL / Qwen2.5-VL over 16 prompts, 8 tokens each: all continuations differ, median gap ~0.3-0.4, 5th
# percentile ~3e-2, where at 0.02 the median was ~0.035 and some prompts shared their continuation), so greedy
# parity between implementations is well defined; activations stay small (|logits| < 10) and fp16-safe. SigLIP
# ignores it (fixed lecun/xavier init); for CLIP it scales the patch and position embeddings.
TINY_INITIALIZER_RANGE = 0.2
# transformers initializes biases to 0 and norm weights to 1; the tiny checkpoints (all but LLaVA's) perturb them
# by this much (random_model's constant_noise), so parity tests catch a bias or norm weight that is dropped,
# swapped between layers or applied in the wrong place.
TINY_CONSTANT_NOISE = 0.2

BUILD_DTYPES = ("float32", "float16", "bfloat16")

# Weight init draws from torch's global RNG; serialize builds so concurrent threads can't interleave draws.
_BUILD_LOCK = threading.Lock()


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """`dtype` as a torch dtype; only float32, float16 and bfloat16 are accepted."""
    import torch

    if isinstance(dtype, str):
        if dtype not in BUILD_DTYPES:
            raise ValueError(f"dtype must be one of {BUILD_DTYPES} or a torch dtype, got {dtype!r}")
        return getattr(torch, dtype)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def random_model(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    *,
    seed: int,
    device: str,
    dtype: torch.dtype,
    constant_noise: float = 0.0,
    tweak: Callable[[PreTrainedModel], None] | None = None,
) -> PreTrainedModel:
    """`model_class(config)` with transformers' own initialization drawn from `seed`, created directly on
    `device` in `dtype` (no fp32 copy, no host round trip). The caller's RNG state (the device's too) is
    left untouched.

    `constant_noise` > 0 adds N(0, constant_noise) to every parameter that transformers initializes to a
    constant (biases to 0, norm weights to 1), so that a parity test notices a bias or norm weight that an
    implementation drops, swaps or misplaces; with constants it could not. `tweak` then changes the
    model in place, under the same seeded RNG (a family's test-friendly adjustments).
    """
    import torch

    from mmengine.models.loader import default_dtype

    target = torch.device(device)
    rng_devices = [target.index if target.index is not None else torch.cuda.current_device()] if target.type == "cuda" else []
    with _BUILD_LOCK, torch.random.fork_rng(devices=rng_devices), target, default_dtype(dtype):
        torch.manual_seed(seed)
        model = model_class(config).to(dtype)
        if constant_noise > 0:
            with torch.no_grad():
                for param in model.parameters():
                    if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                        param.add_(torch.randn_like(param) * constant_noise)
        if tweak is not None:
            with torch.no_grad():
                tweak(model)
        return model


def save_random_model(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    generation_config: GenerationConfig,
    path: str | os.PathLike,
    *,
    seed: int,
    device: str,
    dtype: torch.dtype,
    constant_noise: float = 0.0,
    max_shard_size: str | None = None,
    tweak: Callable[[PreTrainedModel], None] | None = None,
) -> pathlib.Path:
    """Builds `random_model(...)` and saves it with `save_pretrained` as safetensors into `path` (sharded
    when `max_shard_size` is given, e.g. "200KB"); on a GPU its memory is given back afterwards."""
    import torch

    model = random_model(model_class, config, seed=seed, device=device, dtype=dtype, constant_noise=constant_noise, tweak=tweak)
    model.generation_config = generation_config
    save_kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return pathlib.Path(path)
