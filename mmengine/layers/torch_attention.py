"""The reference attention backend in plain PyTorch: correct everywhere, fast nowhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmengine.layers.attention import AttentionMetadata


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first seq_len keys and values, [seq_len, Hkv, D] each, read through its block table."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    key = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    value = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return key, value


def causal_paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [q, Hq, D] holds the last q positions of a context of len(key) positions."""
    q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads, _ = key.shape
    if num_heads != num_kv_heads:
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
    k_pos = torch.arange(kv_len, device=query.device)[None, :]
    mask = k_pos <= q_pos
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


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
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            if q_len == 0:
                continue
            key, value = gather_context(kv_cache, metadata.block_tables[i], seq_len)
            out[start : start + q_len] = causal_paged_attention(query[start : start + q_len], key, value, scale)
            start += q_len
        return out
