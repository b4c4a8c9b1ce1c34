"""The encoder budget: how many embeddings the vision encoder may produce per step, and cache size.

    M          = max embeddings one item can produce (the model family's `max_tokens_per_item`)
    per_step   = 1 if M > max_num_batched_tokens else ceil(max_num_batched_tokens / M)
    slack      = 1        # a step may also need one item for a recomputed last token
    cap        = max_num_seqs * max(items a prompt may hold: limit_mm_per_prompt's images x the items of
                                    the largest picture (its tiles or crops), and its videos x the items
                                    (temporal patches) of the longest video)
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


def compute_encoder_budget(
    max_tokens_per_item: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    limit_mm_per_prompt: dict[str, int],
    pinned_room_tokens: int,
    bytes_per_token: int,
    encoder_cache_size: int | None = None,
    warn: bool = True,
    items_per_video: int = 1,
    items_per_image: int = 1,
) -> EncoderBudget:
    """The budget's terms (see the module docstring). `warn=False` keeps a probing call quiet.
    `items_per_video` / `items_per_image`: the most items one video / picture makes (the family's
    max_items_per_video / max_items_per_image)."""
    m = max_tokens_per_item
    per_step = 1 if m > max_num_batched_tokens else math.ceil(max_num_batched_tokens / m)
    slack = 1
    cap = max_num_seqs * max(items_per_prompt(limit_mm_per_prompt, items_per_video, items_per_image).values(), default=0)
    num_items = min(per_step + slack, cap)
    compute = num_items * m
    if encoder_cache_size is not None:
        compute = encoder_cache_size
        if encoder_cache_size < m and warn:
            logger.warning("encoder_cache_size=%d is below one item (%d embeddings); raised to %d", encoder_cache_size, m, m)
        compute = max(compute, m)
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


def items_per_prompt(limit_mm_per_prompt: dict[str, int], items_per_video: int, items_per_image: int = 1) -> dict[str, int]:
    """The items each modality's limit lets one prompt hold: a video is several items, and so is a picture of
    several tiles or crops."""
    per_item = {"video": items_per_video, "image": items_per_image}
    return {kind: limit * per_item.get(kind, 1) for kind, limit in limit_mm_per_prompt.items()}


def explain_budget(
    budget: EncoderBudget, inputs: dict[str, tuple[object, str]], item_source: str, items_per_video: int = 1,
    items_per_image: int = 1,
) -> list[str]:
    """One line per term of the formula, each with its value and where its inputs came from."""

    def src(name: str) -> str:
        value, source = inputs[name]
        return f"{name}={value} ({source})"

    b = budget
    m = b.max_tokens_per_item
    per_step = "1 (M > max_num_batched_tokens)" if b.items_per_step == 1 and m > inputs["max_num_batched_tokens"][0] else (
        f"ceil({inputs['max_num_batched_tokens'][0]} / {m}) = {b.items_per_step}"
    )
    per_prompt = items_per_prompt(inputs["limit_mm_per_prompt"][0], items_per_video, items_per_image)
    limit = max(per_prompt.values(), default=0)
    if "video" in per_prompt and items_per_video > 1:
        limit = f"{limit} (a video is up to {items_per_video} items)"
    if "image" in per_prompt and items_per_image > 1:
        limit = f"{limit} (a picture is up to {items_per_image} items)"
    override = inputs["encoder_cache_size"][0]
    compute = (
        f"{b.num_items} x {m} = {b.compute_budget_tokens}"
        if override is None
        else f"encoder_cache_size = {b.compute_budget_tokens}" + (" (raised to M)" if override < m else "")
    )
    gib = b.cache_bytes / 2**30
    return [
        f"M (max embeddings per item)   {m:>12}   {item_source}",
        f"items per step                {b.items_per_step:>12}   {per_step}; {src('max_num_batched_tokens')}",
        f"slack items                   {b.slack_items:>12}   a recomputed last token may need one more item in a step",
        f"items cap                     {b.items_cap:>12}   {src('max_num_seqs')} x max limit {limit}; {src('limit_mm_per_prompt')}",
        f"num items                     {b.num_items:>12}   min({b.items_per_step} + {b.slack_items}, {b.items_cap})",
        f"compute budget (embeddings)   {b.compute_budget_tokens:>12}   {compute}; {src('encoder_cache_size')}",
        f"pinned room (embeddings)      {b.pinned_room_tokens:>12}   one per KV token slot: {inputs['kv_tokens'][1]}",
        f"cache capacity (embeddings)   {b.cache_capacity_tokens:>12}   compute budget + pinned room",
        f"bytes per embedding           {b.bytes_per_token:>12}   {inputs['bytes_per_token'][1]}",
        f"cache size (bytes)            {b.cache_bytes:>12}   {gib:.3f} GiB",
    ]
