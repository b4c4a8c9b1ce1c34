"""The Triton attention backend: mmengine's kernels behind the same interface as the reference.

Decode rows (one new token) go to the split-KV paged decode kernel; every other request goes to
the varlen prefill kernel, which reads its cached context and its new tokens from the cache.
"""

from __future__ import annotations

import torch

from mmengine.kernels.decode_attention import choose_num_splits, decode_attention
from mmengine.kernels.kv_store import store_kv
from mmengine.kernels.prefill_attention import prefill_attention
from mmengine.layers.attention import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits  # None: chosen per step from the batch and the longest context
        self._num_sms: int | None = None

    def _sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        return self._num_sms

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, kv_cache, slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        query_lens = metadata.query_lens_cpu
        decode_rows = [i for i, q_len in enumerate(query_lens) if q_len == 1]
        prefill_rows = [i for i, q_len in enumerate(query_lens) if q_len > 1]
        device = query.device
        if decode_rows:
            rows = torch.tensor(decode_rows, device=device)
            token_idx = metadata.query_start_loc[rows].long()
            max_seq = max(metadata.seq_lens_cpu[i] for i in decode_rows)
            num_kv_heads = kv_cache.shape[3]
            splits = self.num_splits or choose_num_splits(len(decode_rows), num_kv_heads, max_seq, self._sm_count(device))
            out[token_idx], _ = decode_attention(
                query[token_idx], kv_cache, metadata.seq_lens[rows], metadata.block_tables[rows], scale, splits
            )
        if prefill_rows:
            prefill_attention(
                query, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale,
                max_query_len=max(query_lens[i] for i in prefill_rows),
                req_indices=torch.tensor(prefill_rows, device=device, dtype=torch.int32),
                out=out,
            )
        return out
