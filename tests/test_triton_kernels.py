"""Triton kernels against the PyTorch reference: without a GPU in Triton's interpreter on CPU tensors
(fp32, fp16; it mishandles bf16), with one compiled on CUDA tensors (fp32, fp16, bf16). conftest.py
turns the interpreter on only when there is no GPU, so the same cases run natively there."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_devices import BF16, CUDA, DEVICES, FP16, FP32, TOL

from mmengine.kernels.decode_attention import decode_attention
from mmengine.layers.split_kv import choose_num_splits
from mmengine.kernels.kv_store import store_kv
from mmengine.kernels.merge_states import merge_attn_states
from mmengine.kernels.prefill_attention import prefill_attention

# The interpreter is slow: a few cases run its fp32 only. Compiled on a GPU every dtype is cheap.
DEVICES_LIGHT = [FP32, FP16, BF16] if CUDA else [FP32, BF16]
# fp32 means fp32 on a GPU too (the reference's einsums included), not TF32
pytestmark = pytest.mark.usefixtures("no_tf32")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal attention in fp32: q holds the last len(q) positions of k/v. Returns (out, lse)."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0], device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > q_pos, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [h, q]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1).nan_to_num(), v)
    return out, lse.transpose(0, 1)


def paged_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=0):
    """Random requests (cached context, new tokens) whose whole K/V already sits in a paged cache."""
    gen = torch.Generator().manual_seed(seed)
    total_blocks = sum(math.ceil((c + n) / block_size) for c, n in shapes) + 3
    cache = torch.randn(2, total_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    free = torch.randperm(total_blocks, generator=gen).tolist()
    tables, ks, vs, qs = [], [], [], []
    for cached, new in shapes:
        table = [free.pop() for _ in range(math.ceil((cached + new) / block_size))]
        tables.append(table)
        flat_k = cache[0, table].flatten(0, 1)[: cached + new]
        flat_v = cache[1, table].flatten(0, 1)[: cached + new]
        ks.append(flat_k)
        vs.append(flat_v)
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen).to(device, dtype))
    width = max(1, max(map(len, tables)))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    query_lens = [n for _, n in shapes]
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([c + n for c, n in shapes], dtype=torch.int32, device=device)
    return cache, block_tables, query_start, seq_lens, qs, ks, vs


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_store_kv_writes_slots_and_skips_padding(device, dtype, head_dim):
    cache = torch.zeros(2, 4, 16, 2, head_dim, device=device, dtype=dtype)
    key = torch.randn(5, 2, head_dim, device=device).to(dtype)
    value = torch.randn(5, 2, head_dim, device=device).to(dtype)
    slots = torch.tensor([3, -1, 17, 63, 0], device=device)
    store_kv(key, value, cache, slots)
    flat_k, flat_v = cache[0].view(-1, 2, head_dim), cache[1].view(-1, 2, head_dim)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[row]) and torch.equal(flat_v[slot], value[row])
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 4  # the -1 row wrote nothing


PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, [(cached context, new tokens), ...])
    (4, 4, 64, 16, [(0, 7), (13, 5), (16, 18)]),
    (8, 2, 80, 16, [(5, 20), (0, 1), (35, 9), (31, 2)]),
    (8, 1, 96, 32, [(0, 33), (40, 3)]),
    (8, 1, 128, 16, [(17, 4), (0, 16)]),
    (6, 2, 64, 16, [(3, 11), (20, 2)]),  # GQA group 3: padded to 4 rows per token
    (7, 1, 64, 32, [(0, 9), (33, 4)]),  # group 7 (Qwen2-7B's 28 over 4), padded to 8
]


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,shapes", PREFILL_CASES)
def test_prefill_matches_reference(device, dtype, num_heads, num_kv_heads, head_dim, block_size, shapes):
    cache, tables, query_start, seq_lens, qs, ks, vs = paged_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, device, dtype)
    scale = head_dim**-0.5
    out, lse = prefill_attention(torch.cat(qs), cache, query_start, seq_lens, tables, scale, max(n for _, n in shapes))
    start = 0
    for q, k, v in zip(qs, ks, vs):
        ref_out, ref_lse = reference(q, k, v, scale)
        torch.testing.assert_close(out[start : start + len(q)].float(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse[start : start + len(q)], ref_lse, atol=TOL[dtype] * 10, rtol=TOL[dtype])
        start += len(q)


DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, context lengths, num_splits)
    (4, 4, 64, 16, [1, 17, 40], 1),
    (8, 2, 80, 16, [5, 33, 100, 64], 4),
    (8, 1, 128, 32, [70, 2, 129], 16),
    (16, 2, 96, 16, [300], 8),
    (6, 2, 64, 16, [9, 50], 2),  # GQA group 3
]


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,lengths,num_splits", DECODE_CASES)
def test_split_kv_decode_matches_reference(device, dtype, num_heads, num_kv_heads, head_dim, block_size, lengths, num_splits):
    shapes = [(n - 1, 1) for n in lengths]
    cache, tables, _, seq_lens, qs, ks, vs = paged_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=1)
    scale = head_dim**-0.5
    out, lse = decode_attention(torch.cat(qs), cache, seq_lens, tables, scale, num_splits)
    for i, (q, k, v) in enumerate(zip(qs, ks, vs)):
        ref_out, ref_lse = reference(q, k, v, scale)
        torch.testing.assert_close(out[i : i + 1].float(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse[i : i + 1], ref_lse, atol=TOL[dtype] * 10, rtol=TOL[dtype])


@pytest.mark.parametrize("device,dtype", DEVICES_LIGHT)
def test_prefill_of_a_request_range_leaves_other_rows_alone(device, dtype):
    """The backend runs prefill over the requests after the leading decodes only, writing into the
    step's shared output: rows of requests outside [first_req, first_req + num_reqs) stay as they were."""
    shapes = [(4, 1), (9, 6), (0, 5), (30, 1)]
    cache, tables, query_start, seq_lens, qs, ks, vs = paged_batch(shapes, 4, 2, 64, 16, device, dtype, seed=2)
    query = torch.cat(qs)
    out = torch.full_like(query, 7.0)
    lse = torch.full((len(query), 4), 7.0, device=device)
    prefill_attention(query, cache, query_start, seq_lens, tables, 0.125, max_query_len=6, first_req=1, num_reqs=2, out=out, lse=lse)
    starts = query_start.tolist()
    for i, (q, k, v) in enumerate(zip(qs, ks, vs)):
        rows = slice(starts[i], starts[i + 1])
        if i in (1, 2):
            torch.testing.assert_close(out[rows].float(), reference(q, k, v, 0.125)[0], atol=TOL[dtype], rtol=TOL[dtype])
        else:
            assert torch.all(out[rows] == 7.0) and torch.all(lse[rows] == 7.0)


@pytest.mark.parametrize("device,dtype", DEVICES_LIGHT)
def test_decode_writes_into_the_given_output(device, dtype):
    shapes = [(12, 1), (40, 1)]
    cache, tables, _, seq_lens, qs, ks, vs = paged_batch(shapes, 4, 2, 64, 16, device, dtype, seed=4)
    step_out = torch.zeros(5, 4, 64, device=device, dtype=dtype)  # the decodes are the first 2 rows
    returned, _ = decode_attention(torch.cat(qs), cache, seq_lens, tables, 0.125, 2, out=step_out[:2])
    assert returned.data_ptr() == step_out.data_ptr()
    for i, (q, k, v) in enumerate(zip(qs, ks, vs)):
        torch.testing.assert_close(step_out[i : i + 1].float(), reference(q, k, v, 0.125)[0], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(step_out[2:] == 0)


@pytest.mark.parametrize("device,dtype", DEVICES_LIGHT)
def test_decode_with_a_context_of_zero_gives_an_empty_state(device, dtype):
    cache = torch.randn(2, 2, 16, 1, 64, device=device).to(dtype)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
    seq_lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    out, lse = decode_attention(torch.randn(2, 4, 64, device=device).to(dtype), cache, seq_lens, tables, 0.125, 4)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
    assert torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_merge_of_two_key_sets_equals_attention_over_their_union(device, dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_dim = 6, 4, 80
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(device)
    k = torch.randn(40, heads, head_dim, generator=gen).to(device)
    v = torch.randn(40, heads, head_dim, generator=gen).to(device)

    def state(keys, values):  # non-causal attention of every query over the given keys
        scores = torch.einsum("qhd,khd->qhk", q, keys) * 0.1
        return torch.einsum("qhk,khd->qhd", scores.softmax(-1), values), torch.logsumexp(scores, -1)

    a, lse_a = state(k[:25], v[:25])
    b, lse_b = state(k[25:], v[25:])
    full, lse_full = state(k, v)
    # empty rows: token 4 has no keys on side b, token 5 has none on either side
    lse_b[4] = float("-inf")
    lse_a[5] = lse_b[5] = float("-inf")
    out, lse = merge_attn_states(a.to(dtype), lse_a, b.to(dtype), lse_b)
    torch.testing.assert_close(out[:4].float(), full[:4], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse[:4], lse_full[:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[4].float(), a[4].to(dtype).float())
    torch.testing.assert_close(lse[4], lse_a[4])
    assert torch.all(out[5] == 0) and torch.all(lse[5] == float("-inf"))


def test_num_splits_grow_for_long_contexts_and_small_batches():
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 32
    assert choose_num_splits(256, 8, 32768, num_sms=132) == 1
    assert choose_num_splits(1, 8, 300, num_sms=132) == 1  # no split shorter than 256 keys
    for reqs in (1, 3, 17):
        n = choose_num_splits(reqs, 2, 4096, num_sms=108)
        assert n & (n - 1) == 0 and 1 <= n <= 16
