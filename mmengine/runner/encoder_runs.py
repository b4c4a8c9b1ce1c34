"""The encoder side of a step: multimodal items through the model's towers, and their outputs into the text embeddings.

It owns how a step's items are encoded (precomputed embeddings copied straight in, pictures of one size in batches
padded to a power of two that start-up warmed, other items in a batch of their own, each through its adapter's
vision LoRA slot), the check that an item's output has one row per placeholder token, the encoder-output books
(device tensors by mm_hash; evicted ones to the host tier, restored ones back), and the writing of those outputs over
their placeholder positions (with Qwen3-VL's DeepStack levels). The runner holds the tensors and the counters and
passes them in: these are functions over plain arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmengine.config import MultimodalConfig
from mmengine.core.request import Request
from mmengine.core.scheduler import ScheduledRequest
from mmengine.encoder_cache.host_tier import EncoderHostTier
from mmengine.layers.lora import ItemLoRAContext
from mmengine.models.family import ModelFamily
from mmengine.models.llama import DeepStack

OnEncoded = Callable[[tuple[str, torch.Tensor]], None]


def encoder_batch_size(num_items: int) -> int:
    """The padded batch a step's one-size items go through the vision tower in: a power of two."""
    return 1 << (num_items - 1).bit_length()


def free_encoder_outputs(outputs: dict[str, torch.Tensor], host_tier: EncoderHostTier | None, mm_hashes: list[str],
                         stale: list[str] = ()) -> None:
    """Drops evicted outputs from the device; the host tier, if any, keeps a copy of those not `stale`
    (made before a reset of the encoder cache)."""
    for mm_hash in mm_hashes:
        output = outputs.pop(mm_hash)
        if host_tier is not None and mm_hash not in stale:
            host_tier.store(mm_hash, output)


def restore_encoder_outputs(outputs: dict[str, torch.Tensor], host_tier: EncoderHostTier | None,
                            scheduled: list[ScheduledRequest], device: torch.device) -> None:
    """Copies the step's items that the host tier holds back to the device (queued, no wait)."""
    for s in scheduled:
        for idx in s.restored_items:
            mm_hash = s.request.mm_items[idx].mm_hash
            outputs[mm_hash] = host_tier.load(mm_hash, device)


def run_encoder(model: torch.nn.Module, family: ModelFamily, outputs: dict[str, torch.Tensor],
                scheduled: list[ScheduledRequest], lora_slots: dict[str, int] | None, *, pad_batches: bool,
                lora_context: ItemLoRAContext | None, on_encoded: OnEncoded | None, device: torch.device,
                dtype: torch.dtype) -> int:
    """Encodes the step's items into `outputs`; those of requests whose adapter changes the vision side
    (`lora_slots`) through their adapter's slot. Returns how many items the towers encoded."""
    jobs = [(s.request, idx) for s in scheduled for idx in s.encoder_items]
    for req, idx in [job for job in jobs if "image_embeds" in job[0].mm_items[job[1]].encoder_inputs]:
        item = req.mm_items[idx]  # precomputed embeddings go straight into the cache: no tower run
        outputs[item.mm_hash] = item.encoder_inputs["image_embeds"].to(device, dtype, copy=True)
    jobs = [(req, idx) for req, idx in jobs if "image_embeds" not in req.mm_items[idx].encoder_inputs]
    # Padded batches hold pictures only (dummy_items' kind): other items (audio clips) go in a batch of their own
    padding = [pad_batches and req.mm_items[idx].modality == "image" for req, idx in jobs]
    padded = [job for job, pad in zip(jobs, padding) if pad]
    rest = [job for job, pad in zip(jobs, padding) if not pad]
    encoded = 0
    for group, pad in ((padded, True), (rest, False)):
        if group:
            _encode_batch(model, family, outputs, group, pad, lora_slots, lora_context, on_encoded, dtype)
            encoded += len(group)
    return encoded


def _encode_batch(model: torch.nn.Module, family: ModelFamily, outputs: dict[str, torch.Tensor],
                  jobs: list[tuple[Request, int]], pad: bool, lora_slots: dict[str, int] | None,
                  context: ItemLoRAContext | None, on_encoded: OnEncoded | None, dtype: torch.dtype) -> None:
    """Encodes items in one encode_items call (padded with dummy items to a warmed-up size when `pad`)."""
    inputs = [req.mm_items[idx].encoder_inputs for req, idx in jobs]
    if pad:
        inputs += family.dummy_items(encoder_batch_size(len(inputs)) - len(inputs))
    if context is not None and lora_slots:
        slots = [lora_slots.get(req.request_id, -1) for req, _ in jobs] + [-1] * (len(inputs) - len(jobs))
        context.items = [(slot, model.encoder_rows(item)) for slot, item in zip(slots, inputs)]
    try:
        embeddings = model.encode_items(inputs)[: len(jobs)]
    finally:
        if context is not None:
            context.items = None
    for (req, idx), emb in zip(jobs, embeddings):
        item = req.mm_items[idx]
        if emb.shape[0] != item.length:
            raise RuntimeError(
                f"the vision encoder produced {emb.shape[0]} embeddings for an item with {item.length} "
                "placeholder tokens; the processor and model configs disagree"
            )
        # a copy: a view would keep the whole step's batch (padding included) alive while any one
        # of its items stays cached, past what the encoder cache counts
        outputs[item.mm_hash] = emb.to(dtype, copy=True)
        if on_encoded is not None:
            on_encoded((item.mm_hash, outputs[item.mm_hash]))


def embed(table: torch.nn.Module, outputs: dict[str, torch.Tensor], input_ids: torch.Tensor,
          scheduled: list[ScheduledRequest], device: torch.device,
          missing_ok: bool = False) -> tuple[torch.Tensor, DeepStack | None]:
    """Text embeddings (from `table`), with each image's embeddings written over its placeholder positions, and
    (Qwen3-VL) the DeepStack levels of those positions. `missing_ok`: an item not encoded yet keeps
    its placeholders' text embeddings (the MTP head's look one token ahead, maybe into the next chunk's)."""
    embeds = table(input_ids)
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    offset = 0
    for s in scheduled:
        for item in s.request.mm_items:
            if not item.overlaps(s.start, s.end):
                continue
            lo, hi = max(s.start, item.offset), min(s.end, item.end)
            emb = outputs.get(item.mm_hash) if missing_ok else outputs[item.mm_hash]
            if emb is None:
                continue
            src.append(emb[lo - item.offset : hi - item.offset])
            dst.append(torch.arange(offset + lo - s.start, offset + hi - s.start, device=device))
        offset += s.num_new_tokens
    if not dst:
        return embeds, None
    rows, values = torch.cat(dst), torch.cat(src).to(embeds.dtype)
    hidden = embeds.shape[1]
    embeds[rows] = values[:, :hidden]
    if values.shape[1] == hidden:
        return embeds, None
    return embeds, DeepStack(rows, values[:, hidden:].reshape(len(rows), -1, hidden).transpose(0, 1))


def warm_up_sizes(images_per_step: int) -> list[int]:
    """The padded batch sizes a step of up to images_per_step pictures can use."""
    return [1 << i for i in range(encoder_batch_size(images_per_step).bit_length())]


def profile_encoder_batches(family: ModelFamily, mm_config: MultimodalConfig, images_per_step: int,
                            encoder_budget_tokens: int) -> list[list]:
    """What the profiling run encodes: a step's worth of the largest pictures and, for a family that
    takes audio, a step's worth (of the encoder budget) of the longest clips (a tower of its own,
    which may take more memory than the pictures' batch)."""
    batches = [family.dummy_items(images_per_step)] if images_per_step > 0 else []
    if "audio" in family.max_tokens_by_modality() and mm_config.limit_mm_per_prompt.get("audio", 0) > 0:
        per_clip = family.max_tokens_per_item({"audio": 1}, mm_config.max_audio_seconds)
        clips = family.dummy_audio_items(max(1, encoder_budget_tokens // per_clip), mm_config.max_audio_seconds)
        if clips:
            batches.append(clips)
    return batches
