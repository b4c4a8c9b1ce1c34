"""The PyTorch reference attention over a paged cache equals dense causal attention."""

from __future__ import annotations

import math

import pytest
import torch

from mmengine.layers.attention import AttentionMetadata
from mmengine.layers.torch_attention import TorchAttentionBackend


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q_len, Hq, D] are the last q_len positions of k/v [kv_len, Hkv, D]; plain softmax(QK^T)V."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 1), (8, 1), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("decodes_first", [True, False])
def test_paged_attention_matches_dense(num_heads, num_kv_heads, block_size, decodes_first):
    torch.manual_seed(num_heads * 10 + num_kv_heads + block_size)
    head_dim, num_blocks = 16, 64
    # (cached context, new tokens): decodes, a fresh prefill, a chunk after a mid-block context
    shapes = [(0, 7), (13, 1), (5, 9), (block_size, 1), (0, 1), (2 * block_size + 3, 5)]
    if decodes_first:  # as the runner orders a batch: the decode path takes the leading requests
        shapes.sort(key=lambda shape: shape[1] != 1)
    backend = TorchAttentionBackend()
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    free = torch.randperm(num_blocks).tolist()
    tables, slots, full_k, full_v = [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(math.ceil(total / block_size))]
        k, v = torch.randn(total, num_kv_heads, head_dim), torch.randn(total, num_kv_heads, head_dim)
        for pos in range(cached):  # the cached context is already in the cache
            cache[0, table[pos // block_size], pos % block_size] = k[pos]
            cache[1, table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        full_k.append(k)
        full_v.append(v)
    query_lens = [new for _, new in shapes]
    seq_lens = [c + n for c, n in shapes]
    width = max(map(len, tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    metadata = AttentionMetadata.build(query_lens, seq_lens, padded, slots, torch.device("cpu"))
    assert metadata.num_decodes == (3 if decodes_first else 0)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    query = torch.randn(sum(query_lens), num_heads, head_dim)
    scale = head_dim**-0.5

    backend.store_kv(new_k, new_v, cache, metadata.slot_mapping)
    out = backend.forward(query, cache, metadata, scale)

    start = 0
    for (_, new), k, v in zip(shapes, full_k, full_v):
        expected = dense_attention(query[start : start + new], k, v, scale)
        torch.testing.assert_close(out[start : start + new], expected, rtol=1e-5, atol=1e-5)
        start += new


def test_store_kv_skips_padding_slots():
    cache = torch.zeros(2, 2, 4, 1, 2)
    key, value = torch.ones(3, 1, 2), 2 * torch.ones(3, 1, 2)
    TorchAttentionBackend().store_kv(key, value, cache, torch.tensor([1, -1, 6]))
    written = (cache[0].reshape(-1, 2) != 0).any(-1).nonzero().flatten().tolist()
    assert written == [1, 6]
    assert torch.equal(cache[1].reshape(-1, 2)[6], torch.tensor([2.0, 2.0]))
