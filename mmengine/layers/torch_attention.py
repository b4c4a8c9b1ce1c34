"""The reference attention backend in plain PyTorch: correct everywhere, simple to read.

The leading decode requests (one new token each) are batched into one padded attention call;
the other requests are handled one at a time with a causal mask offset by the cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmengine.layers.attention import AttentionMetadata


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first seq_len keys and values, [seq_len, Hkv, D] each, read through its block table."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    return kv_cache[0, blocks].flatten(0, 1)[:seq_len], kv_cache[1, blocks].flatten(0, 1)[:seq_len]


def causal_paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """query [q, Hq, D] holds the last q positions of a context of len(key) positions."""
    q_len, kv_len = query.shape[0], key.shape[0]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
    mask = torch.arange(kv_len, device=query.device)[None, :] <= q_pos
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
) -> torch.Tensor:
    """query [B, Hq, D], one token per request, attending to each request's whole context of at
    most max_seq_len keys (a host-side bound, so nothing is read back from the device)."""
    num_reqs, block_size = query.shape[0], kv_cache.shape[2]
    max_blocks = min(-(-max_seq_len // block_size), block_tables.shape[1])
    tables = block_tables[:, :max_blocks].long()
    key = kv_cache[0, tables].flatten(1, 2)  # [B, L, Hkv, D]; padding blocks read block 0 and are masked
    value = kv_cache[1, tables].flatten(1, 2)
    mask = torch.arange(key.shape[1], device=query.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=query.shape[1] != key.shape[2],
    )
    return out.view(num_reqs, *query.shape[1:])


class TorchAttentionBackend:
    name = "torch"

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        kv_cache[0].view(-1, *key.shape[1:])[slot_mapping] = key
        kv_cache[1].view(-1, *value.shape[1:])[slot_mapping] = value

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        nd = metadata.num_decodes  # the leading requests, one token each: tokens [0, nd)
        if nd:
            out[:nd] = batched_decode_attention(
                query[:nd], kv_cache, metadata.block_tables[:nd], metadata.seq_lens[:nd], scale, metadata.max_decode_seq_len
            )
        starts = metadata.query_start_loc_cpu
        for i in range(nd, metadata.num_reqs):
            lo, hi = starts[i], starts[i + 1]
            key, value = gather_context(kv_cache, metadata.block_tables[i], metadata.seq_lens_cpu[i])
            out[lo:hi] = causal_paged_attention(query[lo:hi], key, value, scale)
        return out
