"""The reference attention backend in plain PyTorch: correct everywhere, simple to read.

The leading decode requests (one new token each) are batched into one padded attention call;
the other requests are handled one at a time with a causal mask offset by the cached context
(narrowed by a sliding window or an attention chunk, widened by bidirectional span ends: attention.py states the rule).
With cascade metadata, the same decomposition as the kernels (layers/cascade.py): each request
over its keys after its group's prefix, each group's tokens over the prefix, merged by lse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmengine.kernels.kv_quant import is_fp8, quantize_e4m3
from mmengine.layers.attention import AttentionMetadata
from mmengine.layers.cascade import CascadeMetadata


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first seq_len keys and values, [seq_len, Hkv, D] each, read through its block table
    (as the cache stores them: the callers cast an FP8 cache's values)."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    return kv_cache[0, blocks].flatten(0, 1)[:seq_len], kv_cache[1, blocks].flatten(0, 1)[:seq_len]


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None,
                 span_ends: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """[q, k] bool: key position k_pos[j] visible to the query at q_pos[i], q_pos[i] - window < k <= its
    span end (span_ends[i], else q_pos[i]); with `chunk` C, also floor(q_pos[i] / C) * C <= k."""
    last = q_pos if span_ends is None else span_ends.to(q_pos.dtype)
    visible = k_pos[None, :] <= last[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    if chunk is not None:
        visible &= k_pos[None, :] >= q_pos[:, None] // chunk * chunk
    return visible


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    window: int | None = None, span_ends: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """query [q, Hq, D] holds the last q positions of a context of len(key) positions; causal, or
    the window, chunk and span rule when given (span_ends [q], absolute positions)."""
    q_len, kv_len = query.shape[0], key.shape[0]
    first = 0 if window is None else max(0, kv_len - q_len - window + 1)  # keys left of every query's window
    if chunk is not None:  # keys left of the first query's chunk
        first = max(first, (kv_len - q_len) // chunk * chunk)
    key, value = key[first:].to(query.dtype), value[first:].to(query.dtype)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    mask = visible_keys(q_pos, torch.arange(first, kv_len, device=query.device), window, span_ends, chunk)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(0, 1)


def batched_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """query [B, Hq, D], one token per request, attending to each request's whole context (its last
    `window` keys with a window, those of its own chunk with `chunk`) of at most max_seq_len keys (a host-side bound, so nothing is read
    back from the device)."""
    num_reqs, block_size = query.shape[0], kv_cache.shape[2]
    max_blocks = min(-(-max_seq_len // block_size), block_tables.shape[1])
    tables = block_tables[:, :max_blocks].long()
    key = kv_cache[0, tables].flatten(1, 2).to(query.dtype)  # [B, L, Hkv, D]; padding blocks read block 0 and are masked
    value = kv_cache[1, tables].flatten(1, 2).to(query.dtype)
    k_pos = torch.arange(key.shape[1], device=query.device)[None, :]
    mask = k_pos < seq_lens[:, None]
    if window is not None:
        mask &= k_pos >= seq_lens[:, None] - window
    if chunk is not None:
        mask &= k_pos >= (seq_lens[:, None] - 1) // chunk * chunk
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=query.shape[1] != key.shape[2],
    )
    return out.view(num_reqs, *query.shape[1:])


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [..., q, Hq, D] over key/value [..., k, Hkv, D] where visible [..., q, k]; computed in
    fp32. Returns (out [..., q, Hq, D] fp32, lse [..., q, Hq] natural log): a row with no visible
    key gives out 0 and lse -inf."""
    group = query.shape[-2] // key.shape[-2]
    key = key.float().repeat_interleave(group, -2)
    value = value.float().repeat_interleave(group, -2)
    scores = torch.einsum("...qhd,...khd->...hqk", query.float(), key) * scale
    scores = scores.masked_fill(~visible.unsqueeze(-3), float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [..., h, q]
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    out = torch.einsum("...hqk,...khd->...qhd", probs, value)
    return out, lse.transpose(-1, -2)


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from each one's (out, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    w_a, w_b = torch.exp(lse_a - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


def cascade_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, cascade: CascadeMetadata, scale: float
) -> torch.Tensor:
    num_tokens = query.shape[0]
    out = torch.zeros(num_tokens, *query.shape[1:], dtype=torch.float32, device=query.device)
    lse = torch.full((num_tokens, query.shape[1]), float("-inf"), device=query.device)
    starts, seq_lens, suffix_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu, cascade.suffix_seq_lens_cpu
    nd = metadata.num_decodes
    if nd:  # decodes: each one's whole suffix is visible
        width = max(suffix_lens[:nd])
        max_blocks = -(-width // kv_cache.shape[2])
        tables = cascade.suffix_block_tables[:nd, :max_blocks].long()
        key, value = kv_cache[0, tables].flatten(1, 2)[:, :width], kv_cache[1, tables].flatten(1, 2)[:, :width]
        visible = torch.arange(width, device=query.device)[None, None, :] < cascade.suffix_seq_lens[:nd, None, None]
        decode_out, decode_lse = attention_with_lse(query[:nd, None], key, value, visible, scale)
        out[:nd], lse[:nd] = decode_out[:, 0], decode_lse[:, 0]
    for i in range(nd, metadata.num_reqs):  # prefills: causal, positions shifted by the prefix
        lo, hi = starts[i], starts[i + 1]
        prefix = seq_lens[i] - suffix_lens[i]
        key, value = gather_context(kv_cache, cascade.suffix_block_tables[i], suffix_lens[i])
        q_pos = torch.arange(seq_lens[i] - (hi - lo), seq_lens[i], device=query.device)
        visible = prefix + torch.arange(suffix_lens[i], device=query.device)[None, :] <= q_pos[:, None]
        out[lo:hi], lse[lo:hi] = attention_with_lse(query[lo:hi], key, value, visible, scale)
    group_starts = cascade.group_starts_cpu
    for g in range(cascade.num_groups):  # each group's tokens, from all its requests, over its prefix
        entries = slice(group_starts[g], group_starts[g + 1])
        rows = cascade.token_indices[entries].long()
        prefix = cascade.prefix_lens_cpu[g]
        key, value = gather_context(kv_cache, metadata.block_tables[cascade.group_leaders_cpu[g]], prefix)
        visible = torch.arange(prefix, device=query.device)[None, :] <= cascade.token_positions[entries, None]
        prefix_out, prefix_lse = attention_with_lse(query[rows], key, value, visible, scale)
        out[rows], lse[rows] = merge_states(prefix_out, prefix_lse, out[rows], lse[rows])
    return out.to(query.dtype)


class TorchAttentionBackend:
    name = "torch"

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        if is_fp8(kv_cache.dtype):
            key, value = quantize_e4m3(key, 1.0 / k_scale), quantize_e4m3(value, 1.0 / v_scale)
        kv_cache[0].view(-1, *key.shape[1:])[slot_mapping] = key
        kv_cache[1].view(-1, *value.shape[1:])[slot_mapping] = value

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, *,
                window: int | None = None, span_ends: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        if metadata.cascade is not None:
            if window is not None or span_ends is not None or chunk is not None:
                raise ValueError("cascade attention is causal only: run a windowed or bidirectional layer without it")
            return cascade_attention(query, kv_cache, metadata, metadata.cascade, scale)
        out = torch.empty_like(query)
        nd = metadata.num_decodes  # the leading requests, one token each: tokens [0, nd)
        if nd:  # a decode's span, if any, ends on itself: causal
            out[:nd] = batched_decode_attention(
                query[:nd], kv_cache, metadata.block_tables[:nd], metadata.seq_lens[:nd], scale, metadata.max_decode_seq_len,
                window, chunk,
            )
        starts = metadata.query_start_loc_cpu
        for i in range(nd, metadata.num_reqs):
            lo, hi = starts[i], starts[i + 1]
            key, value = gather_context(kv_cache, metadata.block_tables[i], metadata.seq_lens_cpu[i])
            ends = None if span_ends is None else span_ends[lo:hi]
            out[lo:hi] = paged_attention(query[lo:hi], key, value, scale, window, ends, chunk)
        return out
