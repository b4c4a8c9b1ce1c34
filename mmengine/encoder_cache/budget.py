"""The encoder budget: how many embeddings the vision encoder may produce per step, and cache size.

    M          = max embeddings one item can produce (from the model and processor config)
    per_step   = 1 if M > max_num_batched_tokens else ceil(max_num_batched_tokens / M)
    slack      = 1        # a step may also need one item for a recomputed last token
    cap        = max_num_seqs * max(limit_mm_per_prompt.values())
    num_items  = min(per_step + slack, cap)
    compute    = num_items * M          (or encoder_cache_size, raised to M if below it)

The cache holds `compute` embeddings for unpinned entries plus room for pinned ones, sized
from the KV cache: one embedding slot per KV token slot (num_kv_blocks * block_size). A pinned
entry exists only while a cached KV block ends inside its item's placeholder run, so pinned
embeddings track the placeholder tokens held in the KV cache; an embedding row costs
hidden_size values against a KV slot's 2 * layers * kv_heads * head_dim, i.e. the pinned room
is a small fraction of the KV cache's memory (1/64 for LLaVA-1.5-7B).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderBudget:
    max_tokens_per_item: int
    items_per_step: int
    slack_items: int
    items_cap: int
    num_items: int
    compute_budget_tokens: int
    pinned_room_tokens: int
    cache_capacity_tokens: int
    bytes_per_token: int

    @property
    def cache_bytes(self) -> int:
        return self.cache_capacity_tokens * self.bytes_per_token

    def to_json(self) -> dict[str, int]:
        return asdict(self) | {"cache_bytes": self.cache_bytes}


def max_tokens_per_item(hf_config: PretrainedConfig) -> int:
    """Embeddings per image of a LLaVA-1.5-style model: one per patch, plus CLS when kept."""
    vision = hf_config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    has_cls = vision.model_type == "clip_vision_model"
    strategy = hf_config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
    return patches + int(has_cls) - int(strategy == "default")


def compute_encoder_budget(
    max_tokens_per_item: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    limit_mm_per_prompt: dict[str, int],
    pinned_room_tokens: int,
    bytes_per_token: int,
    encoder_cache_size: int | None = None,
) -> EncoderBudget:
    m = max_tokens_per_item
    per_step = 1 if m > max_num_batched_tokens else math.ceil(max_num_batched_tokens / m)
    slack = 1
    cap = max_num_seqs * max(limit_mm_per_prompt.values(), default=0)
    num_items = min(per_step + slack, cap)
    compute = num_items * m
    if encoder_cache_size is not None:
        compute = encoder_cache_size
        if encoder_cache_size < m:
            logger.warning("encoder_cache_size=%d is below one item (%d embeddings); raised to %d", encoder_cache_size, m, m)
            compute = m
    return EncoderBudget(
        max_tokens_per_item=m,
        items_per_step=per_step,
        slack_items=slack,
        items_cap=cap,
        num_items=num_items,
        compute_budget_tokens=compute,
        pinned_room_tokens=pinned_room_tokens,
        cache_capacity_tokens=compute + pinned_room_tokens,
        bytes_per_token=bytes_per_token,
    )
