"""Cascade attention kernels and backends against dense causal attention: several groups with
different prefixes in one batch, decodes, prefill chunks after the prefix, chunks that start inside
the prefix (which must not see later prefix keys), ungrouped requests, GQA. The Triton kernels run
in Triton's interpreter on CPU (fp32, fp16), natively on a GPU; the PyTorch reference on CPU."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from kernel_devices import BF16, FP16, FP32, TOL

from mmengine.kernels.cascade_attention import merge_prefix_states, shared_prefix_attention
from mmengine.layers.attention import AttentionMetadata
from mmengine.layers.cascade import CascadeGroup, CascadeMetadata, layout_cascade, tokens_per_tile
from mmengine.layers.torch_attention import TorchAttentionBackend, attention_with_lse, merge_states
from mmengine.layers.triton_attention import TritonAttentionBackend

pytestmark = pytest.mark.usefixtures("no_tf32")


@dataclass
class Req:
    prefix: str | None  # the shared prefix it starts with (None: its own blocks only)
    seq_len: int  # context after the step
    q_len: int  # new tokens this step (the last q_len positions)


# prefix name -> blocks; requests in packed order (decodes first)
PREFIXES = {"a": 2, "b": 3, "c": 1}
REQS = [
    Req("a", 40, 1), Req("b", 50, 1), Req("a", 33, 1), Req(None, 20, 1), Req("b", 48, 1), Req("a", 32, 1),  # 32 = the prefix exactly
    Req("a", 45, 7),  # a chunk after the prefix
    Req("b", 52, 12),  # a chunk that starts inside the prefix (positions 40..51, prefix 48)
    Req("c", 16, 3),  # a chunk wholly inside the prefix (a recompute after a full hit)
    Req("c", 30, 9),
    Req(None, 9, 9),
]


def cascade_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=0, num_splits=1):
    """A paged cache holding every request's K/V (shared prefixes in shared blocks), the queries,
    the step's metadata with cascade groups (the prefix pass cut into num_splits), and each
    request's dense (q, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    own = [math.ceil(r.seq_len / block_size) - (PREFIXES[r.prefix] if r.prefix else 0) for r in reqs]
    total = sum(PREFIXES.values()) + sum(own) + 2
    cache = torch.randn(2, total, block_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    free = torch.randperm(total, generator=gen).tolist()
    prefix_blocks = {name: [free.pop() for _ in range(n)] for name, n in PREFIXES.items()}
    tables, dense = [], []
    for r, n_own in zip(reqs, own):
        table = (prefix_blocks[r.prefix] if r.prefix else []) + [free.pop() for _ in range(n_own)]
        tables.append(table)
        q = torch.randn(r.q_len, num_heads, head_dim, generator=gen).to(device, dtype)
        dense.append((q, cache[0, table].flatten(0, 1)[: r.seq_len], cache[1, table].flatten(0, 1)[: r.seq_len]))
    width = max(map(len, tables))
    padded = np.array([t + [free[0]] * (width - len(t)) for t in tables])
    query_lens, seq_lens = [r.q_len for r in reqs], [r.seq_len for r in reqs]
    metadata = AttentionMetadata.build(query_lens, seq_lens, padded, [-1] * sum(query_lens), torch.device(device))
    groups = [
        CascadeGroup([i for i, r in enumerate(reqs) if r.prefix == name], n) for name, n in PREFIXES.items()
    ]
    layout = layout_cascade(groups, np.array(query_lens), np.array(seq_lens), padded, block_size,
                            tokens_per_tile(num_heads, num_kv_heads), num_splits)
    metadata = replace(metadata, cascade=CascadeMetadata.from_layout(layout, torch.device(device)))
    return cache, torch.cat([q for q, _, _ in dense]), metadata, dense


def dense_reference(dense, scale):
    """Each request's queries (its last positions) over its whole context, causal, in fp32."""
    outs = []
    for q, k, v in dense:
        q_pos = torch.arange(len(k) - len(q), len(k))
        visible = torch.arange(len(k))[None, :] <= q_pos[:, None]
        outs.append(attention_with_lse(q.cpu(), k.cpu(), v.cpu(), visible, scale))
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


SHAPES = [
    pytest.param(4, 2, 32, 16, id="gqa2-d32"),
    pytest.param(6, 2, 16, 16, id="gqa3-d16"),  # a group of 3 query heads, padded to 4 rows
    pytest.param(2, 2, 24, 8, id="mha-d24-bs8"),
    pytest.param(64, 1, 16, 16, id="gqa64-d16"),  # 64 query heads fill a tile: one token per tile, many tiles a group
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
def test_torch_reference_decomposition_matches_dense_attention(num_heads, num_kv_heads, head_dim, block_size):
    cache, query, metadata, dense = cascade_batch(REQS, num_heads, num_kv_heads, head_dim, block_size, "cpu", torch.float32)
    out = TorchAttentionBackend().forward(query, cache, metadata, head_dim**-0.5)
    ref, _ = dense_reference(dense, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # and the decomposition is really in use: without groups the same step gives the same answer
    plain = TorchAttentionBackend().forward(query, cache, replace(metadata, cascade=None), head_dim**-0.5)
    torch.testing.assert_close(out, plain, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device,dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (64, 1)])
def test_prefix_kernel_matches_reference(device, dtype, num_splits, num_heads, num_kv_heads):
    """The prefix pass alone: each grouped token over its group's prefix, causal by position; the
    partial states of its splits, merged, equal the reference over the whole prefix (with one
    token per tile, every group spans several tiles)."""
    head_dim, block_size = 32 if num_kv_heads == 2 else 16, 16
    cache, query, metadata, _ = cascade_batch(REQS, num_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=1,
                                              num_splits=num_splits)
    cascade, scale = metadata.cascade, head_dim**-0.5
    part_out, part_lse = shared_prefix_attention(query, cache, cascade, metadata.block_tables, scale)
    assert part_out.shape == (cascade.num_tokens, num_heads, num_splits, head_dim)
    out, lse = part_out[:, :, 0], part_lse[:, :, 0]
    for s in range(1, num_splits):
        out, lse = merge_states(out, lse, part_out[:, :, s], part_lse[:, :, s])
    starts = cascade.group_starts_cpu
    for g in range(cascade.num_groups):
        entries = slice(starts[g], starts[g + 1])
        prefix, leader = cascade.prefix_lens_cpu[g], cascade.group_leaders_cpu[g]
        blocks = metadata.block_tables[leader, : prefix // block_size].long()
        key, value = cache[0, blocks].flatten(0, 1), cache[1, blocks].flatten(0, 1)
        visible = torch.arange(prefix, device=device)[None, :] <= cascade.token_positions[entries, None]
        ref_out, ref_lse = attention_with_lse(query[cascade.token_indices[entries].long()], key, value, visible, scale)
        torch.testing.assert_close(out[entries], ref_out, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse[entries], ref_lse, atol=TOL[dtype] * 10, rtol=TOL[dtype])
    assert torch.isinf(lse).sum() == 0  # every grouped token sees at least key 0


@pytest.mark.parametrize("device,dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("spare_programs", [0, 3])
def test_merge_kernel_folds_prefix_splits_into_scattered_rows(device, dtype, spare_programs):
    """Grouped rows scattered over the batch get the lse-merge of their suffix state and every
    prefix split; empty states (lse -inf) on either side contribute nothing; other rows stay put,
    also when the grid has programs beyond the step's tokens (a CUDA graph's fixed grid)."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, heads, splits, dim = 7, 3, 4, 20
    out = torch.randn(num_tokens, heads, dim, generator=gen).to(device, dtype)
    lse = torch.randn(num_tokens, heads, generator=gen).to(device)
    lse[2, 1] = float("-inf")  # a suffix with no keys
    out[2, 1] = 0
    token_indices = torch.tensor([5, 0, 2] + [1] * spare_programs, dtype=torch.int32, device=device)
    part_out = torch.randn(3 + spare_programs, heads, splits + 1, dim, generator=gen).to(device)  # room for one more split
    part_lse = torch.randn(3 + spare_programs, heads, splits + 1, generator=gen).to(device) * 3
    part_lse[1, :, 3] = float("-inf")  # an empty split
    expected_out, expected_lse = out.clone().float(), lse.clone()
    for entry, token in enumerate(token_indices.tolist()[:3]):
        o, l_ = expected_out[token], expected_lse[token]
        for s in range(splits):
            o, l_ = merge_states(o, l_, part_out[entry, :, s], part_lse[entry, :, s])
        expected_out[token], expected_lse[token] = o, l_
    counts = torch.tensor([0, splits, 3], dtype=torch.int32, device=device)
    merge_prefix_states(out, lse, part_out, part_lse, token_indices, counts)
    torch.testing.assert_close(out.float(), expected_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", [FP32, FP16])
def test_fixed_grids_within_bounds_give_the_same_attention(device, dtype):
    """A cascade graph launches with its bucket's bounds, not the step's counts: more prefix-pass
    programs, merge programs and split room than the step uses. Programs past the counts (read on
    the device) must exit, so the result is the step's own."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    cache, query, metadata, dense = cascade_batch(REQS, num_heads, num_kv_heads, head_dim, block_size, device, dtype,
                                                  seed=4, num_splits=2)
    cascade = metadata.cascade
    padded = replace(cascade, token_indices=torch.cat([cascade.token_indices, torch.zeros_like(cascade.token_indices)]),
                     max_work=cascade.max_work + 5, max_tokens=2 * cascade.max_tokens, max_splits=8)
    backend = TritonAttentionBackend(num_splits=2)
    exact = backend.forward(query, cache, metadata, head_dim**-0.5)
    bounded = backend.forward(query, cache, replace(metadata, cascade=padded), head_dim**-0.5)
    torch.testing.assert_close(bounded, exact, atol=0, rtol=0)
    ref, _ = dense_reference(dense, head_dim**-0.5)
    torch.testing.assert_close(bounded.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device,dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [SHAPES[0], SHAPES[1], SHAPES[3]])
def test_triton_cascade_backend_matches_dense_attention(device, dtype, num_heads, num_kv_heads, head_dim, block_size):
    """The whole Triton path: suffix decode (split-KV) and prefill kernels on shortened tables,
    the prefix pass over three groups with different prefixes, the merge."""
    cache, query, metadata, dense = cascade_batch(REQS, num_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=2)
    backend = TritonAttentionBackend(num_splits=2)
    out = backend.forward(query, cache, metadata, head_dim**-0.5)
    ref, _ = dense_reference(dense, head_dim**-0.5)
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_layout_cuts_the_prefix_off_each_members_table():
    tables = np.array([[7, 8, 1, 2], [7, 8, 3, 0], [5, 6, 4, 0]])
    layout = layout_cascade([CascadeGroup([0, 1], 2)], np.array([1, 3, 2]), np.array([50, 36, 20]), tables, 16, 64)
    assert layout.token_indices.tolist() == [0, 1, 2, 3]  # request 0's one token, request 1's three
    assert layout.token_positions.tolist() == [49, 33, 34, 35]
    assert layout.group_starts.tolist() == [0, 4] and layout.prefix_lens.tolist() == [32]
    assert layout.group_leaders.tolist() == [0]
    assert layout.suffix_seq_lens.tolist() == [18, 4, 20]
    assert layout.suffix_block_tables[:, :2].tolist() == [[1, 2], [3, 0], [5, 6]]


def test_layout_tiles_each_group_and_counts_its_work():
    """The prefix pass's work list: each group's tokens cut into tiles of tile_tokens (the last one
    partial), tiles numbered group after group; a step's work is tiles x splits."""
    tables = np.arange(24).reshape(6, 4) % 3  # rows share blocks: the layout does not check sharing
    groups = [CascadeGroup([0, 1], 1), CascadeGroup([2], 1), CascadeGroup([3, 4, 5], 1)]
    query_lens = np.array([4, 1, 2, 1, 1, 1])
    layout = layout_cascade(groups, query_lens, np.full(6, 30), tables, 16, tile_tokens=2, num_splits=4)
    assert layout.group_starts.tolist() == [0, 5, 7, 10]
    assert layout.tile_groups.tolist() == [0, 0, 0, 1, 2, 2]
    assert layout.tile_starts.tolist() == [0, 2, 4, 5, 7, 9]
    assert layout.num_work == 6 * 4
    metadata = CascadeMetadata.from_layout(layout, torch.device("cpu"))
    assert metadata.counts.tolist() == [24, 4, 10]
    assert (metadata.max_work, metadata.max_tokens, metadata.max_splits) == (24, 10, 4)
