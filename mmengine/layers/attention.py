"""Attention over the paged KV cache: per-step metadata, the backend protocol, and the layer.

A backend provides `store_kv` (write the step's K/V into the cache through the slot
mapping) and `forward` (each request's new queries attend causally to its new tokens
and fully to its cached context, read through its block table). The PyTorch backend
is the reference and the CPU path; kernel backends plug in under another name
(attention_backends.py picks one; the backends import this module, never the reverse).

Masks beyond causal (Gemma 4): a sliding-window layer lets the query at position q see
keys q - window < k only; a layer with attention chunks of C tokens (Llama 4) keys
floor(q / C) * C <= k only (a window whose start is chunk-aligned); a layer with bidirectional
spans also lets a query inside a picture's run of tokens see the later keys of that run: key k is visible iff
q - window < k <= span_ends[token] (span_ends[token] = q outside a span).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from mmengine.errors import CascadeLayoutError
from mmengine.kernels.tiling import CascadeTileMismatch
from mmengine.layers.cascade import CascadeMetadata, tokens_per_tile

if TYPE_CHECKING:
    from mmengine.layers.gated_delta import RecurrentStep
    from mmengine.layers.rotary import RotaryStep


@dataclass
class AttentionMetadata:
    """Describes one step's packed batch. Tensors live on the model's device; the lists and ints
    are their host copies, so backends never read a device tensor back.

    Requests with one new token (decodes) should come first: the leading `num_decodes` requests
    are attended in one batched decode call, the rest as prefills (correct in any order).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot per new token, -1 = don't store
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: offsets of each request's new tokens
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with valid block ids
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    num_decodes: int  # leading requests with exactly one new token
    max_decode_seq_len: int  # an upper bound on the decodes' contexts (a CUDA graph uses max_model_len)
    max_prefill_query_len: int
    # Fixed by a CUDA graph for its batch size (a captured launch cannot change its grid);
    # None lets the backend choose per step from the batch and the longest context.
    decode_num_splits: int | None = None
    # Shared-prefix groups of an eager step (layers/cascade.py); None attends every request alone.
    cascade: CascadeMetadata | None = None
    # The step as the linear-attention layers of a hybrid model see it (layers/gated_delta.py); None otherwise.
    recurrent: RecurrentStep | None = None
    # [num_tokens] int32: for each new token, the position of the last key it may see on a layer with
    # bidirectional spans (its own position outside a picture's run, the run's last one inside it; so
    # they never decrease along a request). A span must lie within one step: keys past the step's end
    # are not seen. None: no spans in this step.
    span_ends: torch.Tensor | None = None
    # The sliding-window layers' own pool (kv_cache/sliding_window.py): each new token's slot and each
    # request's block table there (the null block where blocks left the window). None: one pool for all.
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None
    _window_view: AttentionMetadata | None = field(default=None, repr=False, compare=False)

    def over_window_pool(self) -> AttentionMetadata:
        """The step as a sliding-window layer sees it: its pool's slots and block tables (this metadata
        when there is no such pool). Made once per step, at the first windowed layer."""
        if self.window_block_tables is None:
            return self
        if self._window_view is None:
            self._window_view = replace(self, slot_mapping=self.window_slot_mapping, block_tables=self.window_block_tables,
                                        window_slot_mapping=None, window_block_tables=None, cascade=None)
        return self._window_view

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: torch.Tensor | Sequence[int],
        device: torch.device,
        span_ends: torch.Tensor | Sequence[int] | None = None,
    ) -> AttentionMetadata:
        """From host-side values: per-request query and sequence lengths, the block tables (rows
        padded to one width), each new token's cache slot and, optionally, span ends. (The runner
        fills persistent buffers instead; this is for tests and one-off runs.)"""
        starts = [0, *itertools.accumulate(query_lens)]
        num_decodes = decode_prefix_length(query_lens)
        return cls(
            slot_mapping=torch.as_tensor(slot_mapping, dtype=torch.long).to(device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.as_tensor(np.asarray(block_tables), dtype=torch.int32).to(device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            query_start_loc_cpu=starts,
            num_decodes=num_decodes,
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
            max_prefill_query_len=max(query_lens[num_decodes:], default=0),
            span_ends=None if span_ends is None else torch.as_tensor(span_ends, dtype=torch.int32).to(device),
        )

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def decode_prefix_length(query_lens: Sequence[int]) -> int:
    """How many leading requests have exactly one new token."""
    return next((i for i, q_len in enumerate(query_lens) if q_len != 1), len(query_lens))


class AttentionBackend(Protocol):
    name: str

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None: ...

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, *,
        window: int | None = None, span_ends: torch.Tensor | None = None, chunk: int | None = None,
    ) -> torch.Tensor:
        """Attention of the step's new tokens; with `window`, key k is visible to the query at q only
        if q - window < k; with `chunk` C, only if floor(q / C) * C <= k (a layer without chunks does not
        pass it, so a backend that never sees chunked layers need not take it); with `span_ends`
        ([num_tokens] int32), a new token's keys reach up to its span end instead of its own position (decodes are causal)."""
        ...


class Attention(nn.Module):
    """Rotates q and k, stores the step's K/V into this layer's cache, then attends.

    On the fused path one Triton kernel rotates q and k and writes k and v into the cache, so the
    backend's store is skipped; on the reference path the rotation is PyTorch and the backend stores.
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], bound by the runner. An FP8 cache
    holds K / k_scale and V / v_scale (the checkpoint's per-layer scales, else 1.0): the key scale
    joins the softmax scale and the value scale multiplies the output.

    `sliding_window` W limits each query to its last W keys (its own included); `attention_chunk` C
    to the keys of its own chunk of C positions (both kinds keep their blocks in the window pool); with
    `bidirectional_spans`, the step's `metadata.span_ends` (when given) extend a query inside a
    picture's run to the run's later keys. Cascade (shared-prefix) attention is causal only, so
    a layer with any of these runs a cascade step without it (a window reads little of a prefix anyway);
    so does a layer whose GQA group differs from the one the step's layout was tiled for
    (runner/cascade_plan.py cascade_layer_shape).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, bidirectional_spans: bool = False,
                 attention_chunk: int | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if attention_chunk is not None and (attention_chunk < 1 or sliding_window is not None):
            raise ValueError(f"attention_chunk must be at least 1 and without a sliding window, got {attention_chunk}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.attention_chunk = attention_chunk
        self.bidirectional_spans = bidirectional_spans
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.source: list[Attention] = []  # a KV-shared layer's source (a list: not a submodule)
        self.layer_index: int | None = None  # among the model's attention layers (set when the cache is bound)

    def read_cache_of(self, source: Attention) -> None:
        """This layer stores no K/V and attends over `source`'s cache, scales and backend (Gemma 4's
        KV-shared layers); it is then called with k = v = None and q already rotated."""
        self.source = [source]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, metadata: AttentionMetadata,
        rotary: RotaryStep | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (rotated here when `rotary` is given) -> [T, Hq * D]."""
        if self.sliding_window is not None or self.attention_chunk is not None:
            metadata = metadata.over_window_pool()
        if self.source:
            return self._attend(q, metadata, self.source[0])
        assert self.kv_cache is not None and self.backend is not None, "KV cache not bound"
        if rotary is not None and rotary.use_kernel:
            from mmengine.kernels.rotary import rotary_store_kv

            rotary_store_kv(q, k, v, rotary.positions, rotary.cos_sin, self.kv_cache, metadata.slot_mapping, rotary.mrope_section,
                            mrope_interleaved=rotary.mrope_interleaved, k_scale=self.k_scale, v_scale=self.v_scale)
        else:
            if rotary is not None:
                q, k = rotary.apply(q, k)
            self.backend.store_kv(k, v, self.kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        return self._attend(q, metadata, self)

    def _attend(self, q: torch.Tensor, metadata: AttentionMetadata, owner: Attention) -> torch.Tensor:
        """q over `owner`'s cache (this layer's, or a KV-shared layer's source)."""
        assert owner.kv_cache is not None and owner.backend is not None, "KV cache not bound"
        span_ends = metadata.span_ends if self.bidirectional_spans else None
        cascade = metadata.cascade
        local = self.sliding_window is not None or self.attention_chunk is not None
        if cascade is not None and (local or span_ends is not None
                                    or cascade.tile_tokens != tokens_per_tile(self.num_heads, owner.num_kv_heads)):
            metadata = replace(metadata, cascade=None)
        try:
            chunk = {} if self.attention_chunk is None else {"chunk": int(self.attention_chunk)}
            out = owner.backend.forward(q, owner.kv_cache, metadata, self.scale * owner.k_scale,
                                        window=self.sliding_window, span_ends=span_ends, **chunk)
        except CascadeTileMismatch as err:
            raise CascadeLayoutError(f"attention layer {self.layer_index}: {err}") from err
        if owner.v_scale != 1.0:
            out = out * owner.v_scale
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
