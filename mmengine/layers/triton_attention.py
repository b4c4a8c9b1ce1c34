"""The Triton attention backend: mmengine's kernels behind the same interface as the reference.

The leading decode requests (one new token each) go to the split-KV paged decode kernel; the
other requests go to the varlen prefill kernel, which reads their cached context and new tokens
from the cache.
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

    def choose_num_splits(self, num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
        return choose_num_splits(num_reqs, num_kv_heads, max_seq_len, self._sm_count(device))

    def warm_up(self, num_heads: int, head_dim: int, kv_cache: torch.Tensor, max_seq_len: int, dtype: torch.dtype) -> None:
        """Compiles every configuration an eager step can launch on this cache: the decode kernels
        for each split count the heuristic can pick, and prefill after decodes (first_req > 0)."""
        device = kv_cache.device
        num_kv_heads = kv_cache.shape[3]
        query = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
        seq_lens = torch.ones(2, dtype=torch.int32, device=device)
        block_tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
        most = self.choose_num_splits(1, num_kv_heads, max_seq_len, device)
        for splits in (1 << i for i in range(most.bit_length())):
            decode_attention(query[:1], kv_cache, seq_lens[:1], block_tables[:1], 1.0, splits)
        query_start_loc = torch.arange(3, dtype=torch.int32, device=device)
        for first_req in (0, 1):
            prefill_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, 1.0, max_query_len=1,
                              first_req=first_req, num_reqs=2 - first_req)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, kv_cache, slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        nd = metadata.num_decodes  # the leading requests, one token each: tokens [0, nd)
        if nd:
            splits = metadata.decode_num_splits or self.num_splits or self.choose_num_splits(
                nd, kv_cache.shape[3], metadata.max_decode_seq_len, query.device
            )
            decode_attention(
                query[:nd], kv_cache, metadata.seq_lens[:nd], metadata.block_tables[:nd], scale, splits, out=out[:nd]
            )
        if nd < metadata.num_reqs:
            prefill_attention(
                query, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale,
                max_query_len=metadata.max_prefill_query_len, first_req=nd, num_reqs=metadata.num_reqs - nd, out=out,
            )
        return out
