"""Llama 4's chunked local attention masks: the query at position q sees key k iff floor(q / C) * C <= k <= q.

The PyTorch backend is checked against dense attention under a mask built straight from the rule, the Triton
kernels (Triton's interpreter on CPU at tiny shapes, fp32 and fp16; natively on a GPU) against the rule and the
PyTorch backend, decodes (split-KV, splits left empty by the chunk) and prefills (query tiles that start in a later
chunk than the step's first token, chunk boundaries inside tiles) alike; each case depends on its chunk."""

from __future__ import annotations

import math

import pytest
import torch
from test_attention_masks import FP16, FP32, TOL, Req, dense_attention, paged_batch

from mmengine.kernels.decode_attention import decode_attention
from mmengine.kernels.prefill_attention import prefill_attention
from mmengine.layers.torch_attention import TorchAttentionBackend
from mmengine.layers.triton_attention import TritonAttentionBackend

pytestmark = pytest.mark.usefixtures("no_tf32")

BATCH = [
    Req(30, 1), Req(15, 1), Req(16, 1), Req(0, 1),  # decodes at, before and after chunk boundaries
    Req(0, 20),  # a prompt crossing a boundary of 8 and 16
    Req(12, 25),  # a chunk after a cached context, crossing several boundaries
    Req(40, 30),
    Req(3, 2),
]


def chunk_mask(req: Req, chunk: int | None) -> torch.Tensor:
    """[new, seq_len] bool, element by element from the rule."""
    size = math.inf if chunk is None else chunk
    return torch.tensor([[(0 if chunk is None else q // size * size) <= k <= q for k in range(req.seq_len)]
                         for q in range(req.cached, req.seq_len)])


def chunk_reference(reqs, query, dense, scale, chunk):
    outs, lses, start = [], [], 0
    for req, (key, value) in zip(reqs, dense):
        out, lse = dense_attention(query[start : start + req.new], key, value, chunk_mask(req, chunk), scale)
        outs.append(out)
        lses.append(lse)
        start += req.new
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("chunk", [None, 1, 8, 16, 100])
def test_torch_backend_follows_the_rule(chunk):
    cache, query, metadata, dense = paged_batch(BATCH, 4, 2, 16, 4, "cpu", torch.float32)
    scale = 16**-0.5
    out = TorchAttentionBackend().forward(query, cache, metadata, scale, chunk=chunk)
    expected, _ = chunk_reference(BATCH, query, dense, scale, chunk)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_every_row_past_its_first_chunk_depends_on_the_chunk():
    cache, query, metadata, dense = paged_batch(BATCH, 4, 2, 16, 4, "cpu", torch.float32, seed=5)
    backend, scale = TorchAttentionBackend(), 16**-0.5
    chunked, full = backend.forward(query, cache, metadata, scale, chunk=8), backend.forward(query, cache, metadata, scale)
    changed = torch.cat([(chunk_mask(r, 8) != chunk_mask(r, None)).any(-1) for r in BATCH])
    diff = (chunked - full).abs().amax((1, 2))
    assert changed.any() and bool((diff[changed] > 1e-3).all()) and bool((diff[~changed] < 1e-6).all())


@pytest.mark.parametrize("device,dtype,chunk", [(*FP32.values, 8), (*FP32.values, 16), (*FP16.values, 8)])
def test_triton_backend_equals_the_rule_and_the_torch_backend(device, dtype, chunk):
    """Decodes (split-KV) and prefills in one step through the backend, as the layer calls it."""
    cache, query, metadata, dense = paged_batch(BATCH, 4, 2, 16, 4, device, dtype, seed=1)
    scale = 16**-0.5
    out = TritonAttentionBackend(num_splits=2).forward(query, cache, metadata, scale, chunk=chunk)
    expected = TorchAttentionBackend().forward(query.float(), cache.float(), metadata, scale, chunk=chunk)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    ref, _ = chunk_reference(BATCH, query, dense, scale, chunk)
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("chunk", [3, 16])
def test_prefill_kernel_tiles_follow_the_rule(chunk):
    """Small tiles, so that query tiles start in later chunks than the step's first token (key tiles skipped) and
    chunk boundaries fall inside tiles: output and lse against the rule."""
    reqs = [Req(0, 9), Req(37, 41), Req(5, 33)]
    device, dtype = FP32.values
    cache, query, metadata, dense = paged_batch(reqs, 4, 2, 16, 4, device, dtype, seed=2)
    scale = 16**-0.5
    out, lse = prefill_attention(query, cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale,
                                 max_query_len=metadata.max_prefill_query_len, block_q=8, block_n=16, chunk=chunk)
    ref_out, ref_lse = chunk_reference(reqs, query, dense, scale, chunk)
    torch.testing.assert_close(out.float().cpu(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=TOL[dtype] * 10, rtol=TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 4])
def test_split_kv_decode_with_a_chunk_follows_the_rule(num_splits):
    """Contexts ending at, before and after chunk boundaries; 4 splits of a short chunk leave some empty."""
    reqs = [Req(n - 1, 1) for n in (1, 8, 9, 16, 17, 40, 70)]
    device, dtype = FP32.values
    cache, query, metadata, dense = paged_batch(reqs, 8, 2, 16, 4, device, dtype, seed=3)
    scale = 16**-0.5
    out, lse = decode_attention(query, cache, metadata.seq_lens, metadata.block_tables, scale, num_splits, chunk=8)
    ref_out, ref_lse = chunk_reference(reqs, query, dense, scale, 8)
    torch.testing.assert_close(out.float().cpu(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=TOL[dtype] * 10, rtol=TOL[dtype])
