"""ModelRunner: scheduler output -> tensors -> vision encoder + decoder -> sampled tokens.

No policy here: the runner computes exactly what the scheduler asked for.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

from mmengine.config import EngineConfig
from mmengine.errors import ConfigError
from mmengine.kv_cache.manager import cdiv
from mmengine.layers.attention import AttentionMetadata, get_attention_backend
from mmengine.models.llama import head_dim_of
from mmengine.models.loader import iter_checkpoint
from mmengine.models.registry import model_class_for
from mmengine.sampling import Sampler
from mmengine.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    scheduled: list[ScheduledRequest]  # in the order of the packed batch
    sampled: list[ScheduledRequest]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: PretrainedConfig,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.text_config = hf_config.text_config
        with torch.device(device), _default_dtype(dtype):
            self.model = model_class_for(hf_config)(hf_config)
        self.model.load_weights(iter_checkpoint(model_dir))
        self.model.eval()
        self.attn_backend = get_attention_backend(config.attn_backend, device)
        self.sampler = Sampler(config.seed)
        self.encoder_outputs: dict[str, torch.Tensor] = {}  # the encoder cache's tensors, by mm_hash
        self.kv_cache: torch.Tensor | None = None
        self.num_encoder_runs = 0  # items encoded

    # -- KV cache -----------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        t = self.text_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * t.num_hidden_layers * self.block_size * t.num_key_value_heads * head_dim_of(t) * elem

    @property
    def embedding_bytes(self) -> int:
        """Bytes of one encoder output row (one image placeholder's embedding)."""
        return self.text_config.hidden_size * torch.empty((), dtype=self.dtype).element_size()

    def determine_num_kv_blocks(self, encoder_fixed_bytes: int, encoder_bytes_per_block: int, images_per_step: int) -> int:
        """KV blocks that fit in the memory left after the encoder cache's fixed part; each block
        also pays for its share of the encoder cache's pinned room."""
        useful = self.config.max_num_seqs * cdiv(self.max_model_len, self.block_size)
        if self.device.type == "cuda":
            available = self._profile_kv_cache_bytes(images_per_step)
        else:
            available = self.config.cpu_kv_cache_bytes
        per_block = self.kv_block_bytes + encoder_bytes_per_block
        num_blocks = min((available - encoder_fixed_bytes) // per_block, useful)
        if self.config.num_kv_blocks is not None:
            num_blocks = min(num_blocks, self.config.num_kv_blocks) if self.device.type == "cuda" else self.config.num_kv_blocks
        if num_blocks < 1:
            raise ConfigError(
                f"no memory left for the KV cache ({available} bytes available, {encoder_fixed_bytes} for the encoder "
                f"cache, {per_block} bytes per block)"
            )
        return int(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        t = self.text_config
        shape = (t.num_hidden_layers, 2, num_blocks, self.block_size, t.num_key_value_heads, head_dim_of(t))
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._bind_kv_cache(self.kv_cache)

    def _bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for i, attn in enumerate(self.model.language_model.attention_layers()):
            attn.kv_cache = kv_cache[i]
            attn.backend = self.attn_backend

    def _profile_kv_cache_bytes(self, images_per_step: int) -> int:
        """Runs the largest step once (a full token budget, a full encoder budget) and returns what is
        left for the KV cache under gpu_memory_utilization."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_blocks = cdiv(num_tokens, self.block_size)
        self.allocate_kv_cache(num_blocks)
        with torch.inference_mode():
            size = getattr(self.model.config.vision_config, "image_size", 336)
            if images_per_step > 0:
                self.model.encode_images(torch.zeros(images_per_step, 3, size, size, device=self.device))
            metadata = AttentionMetadata.build(
                query_lens=[num_tokens], seq_lens=[num_tokens], block_tables=[list(range(num_blocks))],
                slot_mapping=torch.arange(num_tokens), device=self.device,
            )
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            hidden = self.model(self.model.embed_tokens(ids), torch.arange(num_tokens, device=self.device), metadata)
            self.model.compute_logits(hidden[-self.config.max_num_seqs :])
        torch.cuda.synchronize(self.device)
        self.kv_cache = None
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        available = int(total * self.config.gpu_memory_utilization) - peak - non_torch
        logger.info("KV cache profile: total %d, peak %d, non-torch %d -> %d bytes for KV", total, peak, non_torch, available)
        return max(available, 0)

    # -- one step -----------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> dict[str, int]:
        """Runs one step and returns the sampled token of every request whose step reached its last token."""
        self.free_encoder_outputs(out.freed_encoder_hashes)
        self._run_encoder(out.scheduled)
        scheduled = [s for s in out.scheduled if s.num_new_tokens > 0]  # zero-token requests just wait
        if not scheduled:
            return {}
        inputs = self._prepare_inputs(scheduled, block_tables)
        embeds = self._embed(inputs.input_ids, inputs.scheduled)
        hidden = self.model(embeds, inputs.positions, inputs.metadata)
        if not inputs.sampled:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        tokens = self.sampler(
            logits,
            [s.request.sampling_params for s in inputs.sampled],
            [s.request.generator for s in inputs.sampled],
        ).tolist()
        return {s.request.request_id: tok for s, tok in zip(inputs.sampled, tokens)}

    def free_encoder_outputs(self, mm_hashes: list[str]) -> None:
        for mm_hash in mm_hashes:
            del self.encoder_outputs[mm_hash]

    def _run_encoder(self, scheduled: list[ScheduledRequest]) -> None:
        jobs = [(s.request, idx) for s in scheduled for idx in s.encoder_items]
        if not jobs:
            return
        pixel_values = torch.stack([req.mm_items[idx].encoder_inputs["pixel_values"] for req, idx in jobs])
        embeddings = self.model.encode_images(pixel_values.to(self.device))
        for (req, idx), emb in zip(jobs, embeddings):
            item = req.mm_items[idx]
            if emb.shape[0] != item.length:
                raise RuntimeError(
                    f"the vision encoder produced {emb.shape[0]} embeddings for an item with {item.length} "
                    "placeholder tokens; the processor and model configs disagree"
                )
            self.encoder_outputs[item.mm_hash] = emb.to(self.dtype)
        self.num_encoder_runs += len(jobs)

    def _prepare_inputs(self, scheduled: list[ScheduledRequest], block_tables: dict[str, list[int]]) -> StepInputs:
        # Decodes first: the attention backends take the leading one-token requests as one batch.
        scheduled = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        query_lens = np.array([s.num_new_tokens for s in scheduled])
        starts = np.array([s.start for s in scheduled])
        # A last token recomputed after a full prefix hit sits in a shared cached block
        # that already holds its K/V: it is attended to, never written again (slot -1).
        hit_ends = np.array([s.request.num_prefix_hit_tokens for s in scheduled])
        tables = [block_tables[s.request.request_id] for s in scheduled]
        table = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
        for row, t in zip(table, tables):
            row[: len(t)] = t
        req_of_token = np.repeat(np.arange(len(scheduled)), query_lens)
        token_starts = np.cumsum(query_lens) - query_lens
        positions = np.arange(int(query_lens.sum())) - token_starts[req_of_token] + starts[req_of_token]
        bs = self.block_size
        slots = table[req_of_token, positions // bs] * bs + positions % bs
        slots[positions < hit_ends[req_of_token]] = -1
        input_ids = [t for s in scheduled for t in s.request.all_token_ids[s.start : s.end]]
        sampled = [s for s in scheduled if s.samples]
        logits_indices = [int(token_starts[i] + query_lens[i] - 1) for i, s in enumerate(scheduled) if s.samples]
        dev = self.device
        metadata = AttentionMetadata.build(
            query_lens=query_lens.tolist(),
            seq_lens=(starts + query_lens).tolist(),
            block_tables=table,
            slot_mapping=torch.from_numpy(slots),
            device=dev,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            scheduled=scheduled,
            sampled=sampled,
        )

    def _embed(self, input_ids: torch.Tensor, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """Text embeddings, with each image's embeddings written over its placeholder positions."""
        embeds = self.model.embed_tokens(input_ids)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        offset = 0
        for s in scheduled:
            for item in s.request.mm_items:
                if not item.overlaps(s.start, s.end):
                    continue
                lo, hi = max(s.start, item.offset), min(s.end, item.end)
                emb = self.encoder_outputs[item.mm_hash]
                src.append(emb[lo - item.offset : hi - item.offset])
                dst.append(torch.arange(offset + lo - s.start, offset + hi - s.start, device=self.device))
            offset += s.num_new_tokens
        if dst:
            embeds[torch.cat(dst)] = torch.cat(src).to(embeds.dtype)
        return embeds

