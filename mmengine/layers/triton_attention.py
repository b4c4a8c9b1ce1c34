"""The Triton attention backend: mmengine's kernels behind the same interface as the reference.

The leading decode requests (one new token each) go to the split-KV paged decode kernel; the
other requests go to the varlen prefill kernel, which reads their cached context and new tokens
from the cache. With cascade metadata the same two kernels attend each request over its keys after
its group's prefix (shortened block tables), then the prefix pass attends each group's tokens over
the prefix and merges (kernels/cascade_attention.py). A sliding window and an attention chunk go to
both kernels, span ends to the prefill kernel (decodes are causal); the layer never sends them with
cascade metadata.
"""

from __future__ import annotations

import numpy as np
import torch

from mmengine.kernels.cascade_attention import cascade_prefix_attention
from mmengine.kernels.decode_attention import decode_attention
from mmengine.kernels.kv_store import store_kv
from mmengine.kernels.prefill_attention import prefill_attention
from mmengine.layers.attention import AttentionMetadata
from mmengine.layers.cascade import CascadeGroup, CascadeMetadata, layout_cascade, tokens_per_tile
from mmengine.layers.split_kv import choose_num_splits


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits  # None: chosen per step from the batch and the longest context
        self._num_sms: int | None = None

    def sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        return self._num_sms

    def choose_num_splits(self, num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
        return choose_num_splits(num_reqs, num_kv_heads, max_seq_len, self.sm_count(device))

    def warm_up(self, num_heads: int, head_dim: int, kv_cache: torch.Tensor, max_seq_len: int, dtype: torch.dtype,
                bidirectional_spans: bool = False) -> None:
        """Compiles every configuration an eager step can launch on this cache: the decode kernels
        for each split count the heuristic can pick, prefill after decodes (first_req > 0) and, for
        a model with bidirectional spans, prefill with span ends. (A window is a plain argument of
        every kernel: no configuration of its own.)"""
        device = kv_cache.device
        num_kv_heads = kv_cache.shape[3]
        query = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
        seq_lens = torch.ones(2, dtype=torch.int32, device=device)
        block_tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
        most = self.choose_num_splits(1, num_kv_heads, max_seq_len, device)
        for splits in (1 << i for i in range(most.bit_length())):
            decode_attention(query[:1], kv_cache, seq_lens[:1], block_tables[:1], 1.0, splits)
        query_start_loc = torch.arange(3, dtype=torch.int32, device=device)
        span_ends = torch.zeros(2, dtype=torch.int32, device=device)
        for ends in (None, span_ends) if bidirectional_spans else (None,):
            for first_req in (0, 1):
                prefill_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, 1.0, max_query_len=1,
                                  first_req=first_req, num_reqs=2 - first_req, span_ends=ends)
        # the cascade prefix pass and merge read their counts on the device: one compile each
        block_size = kv_cache.shape[2]
        layout = layout_cascade([CascadeGroup([0, 1], 1)], np.ones(2, dtype=np.int64), np.full(2, block_size),
                                np.zeros((2, 1), dtype=np.int64), block_size, tokens_per_tile(num_heads, num_kv_heads), 2)
        cascade = CascadeMetadata.from_layout(layout, device)
        lse = torch.zeros(2, num_heads, dtype=torch.float32, device=device)
        cascade_prefix_attention(query, kv_cache, cascade, block_tables, 1.0, query.clone(), lse)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        store_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, *,
                window: int | None = None, span_ends: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        cascade = metadata.cascade
        if cascade is not None and (window is not None or span_ends is not None or chunk is not None):
            raise ValueError("cascade attention is causal only: run a windowed or bidirectional layer without it")
        out = torch.empty_like(query)
        # with cascade, each request first attends to its keys after its group's prefix
        seq_lens, block_tables = (metadata.seq_lens, metadata.block_tables) if cascade is None else (
            cascade.suffix_seq_lens, cascade.suffix_block_tables
        )
        lse = None if cascade is None else torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        nd = metadata.num_decodes  # the leading requests, one token each: tokens [0, nd)
        if nd:
            splits = metadata.decode_num_splits or self.num_splits
            if splits is None:
                longest = metadata.max_decode_seq_len if cascade is None else max(cascade.suffix_seq_lens_cpu[:nd])
                longest = min([longest, *(span for span in (window, chunk) if span is not None)])  # the keys a decode reads
                splits = self.choose_num_splits(nd, kv_cache.shape[3], longest, query.device)
            decode_attention(
                query[:nd], kv_cache, seq_lens[:nd], block_tables[:nd], scale, splits, out=out[:nd],
                lse=None if lse is None else lse[:nd], window=window, chunk=chunk,
            )
        if nd < metadata.num_reqs:
            prefill_attention(
                query, kv_cache, metadata.query_start_loc, seq_lens, block_tables, scale,
                max_query_len=metadata.max_prefill_query_len, first_req=nd, num_reqs=metadata.num_reqs - nd, out=out,
                lse=lse, window=window, span_ends=span_ends, chunk=chunk,
            )
        if cascade is not None:
            cascade_prefix_attention(query, kv_cache, cascade, metadata.block_tables, scale, out, lse)
        return out
