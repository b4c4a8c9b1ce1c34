"""Gemma 4's attention masks: sliding windows and bidirectional picture spans.

The rule (layers/attention.py): the query at position q of a new token sees key k iff
q - window < k <= span_end, where span_end is the last position of the token's picture run inside
one and q outside (a layer without a window has window = infinity). The PyTorch backend is checked
against dense attention under a mask built straight from that rule, the Triton kernels (Triton's
interpreter on CPU, fp32 and fp16; natively on a GPU) against the PyTorch backend and the same
mask, and each case is shown to depend on its window and its spans."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from kernel_devices import BF16, FP16, FP32, KERNEL_DEVICE, TOL

from mmengine.kernels.common import NO_WINDOW, kernel_window
from mmengine.kernels.decode_attention import decode_attention
from mmengine.kernels.prefill_attention import prefill_attention
from mmengine.layers.attention import Attention, AttentionMetadata
from mmengine.layers.cascade import CascadeGroup, CascadeMetadata, layout_cascade, tokens_per_tile
from mmengine.layers.torch_attention import TorchAttentionBackend
from mmengine.layers.triton_attention import TritonAttentionBackend

pytestmark = pytest.mark.usefixtures("no_tf32")


@dataclass(frozen=True)
class Req:
    cached: int  # context already in the cache
    new: int  # tokens of this step (positions cached .. cached + new - 1)
    spans: tuple[tuple[int, int], ...] = ()  # picture runs among the new tokens: (first, last) positions

    @property
    def seq_len(self) -> int:
        return self.cached + self.new

    def span_ends(self) -> list[int]:
        ends = list(range(self.cached, self.seq_len))
        for first, last in self.spans:
            assert self.cached <= first <= last < self.seq_len, "a span lies within one step"
            ends[first - self.cached : last - self.cached + 1] = [last] * (last - first + 1)
        return ends


# Decodes first (the backends' decode path takes the leading one-token requests), then prefills.
BATCH = [
    Req(30, 1), Req(5, 1), Req(7, 1), Req(0, 1),  # contexts longer and shorter than a window of 8
    Req(0, 20, spans=((0, 5),)),  # a prompt that opens with a picture
    # a chunk after a cached context, opening with a picture; then a picture longer than the window: its
    # early queries see 13 later keys, its late ones have lost its first keys to the window's left edge
    Req(12, 25, spans=((12, 15), (20, 33))),
    Req(40, 30, spans=((50, 55),)),  # a picture in the middle of a chunk whose query tiles start far right
    Req(3, 2),
]
WINDOWS = [None, 1, 4, 8, 100]  # 100: wider than every context


def paged_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=0, cache_dtype=None):
    """A paged cache holding every request's whole K/V (as the layer leaves it before attending), the
    step's queries and metadata (with span ends), and each request's dense K/V."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(math.ceil(r.seq_len / block_size) for r in reqs) + 2
    cache = torch.randn(2, total, block_size, num_kv_heads, head_dim, generator=gen).to(device, cache_dtype or dtype)
    free = torch.randperm(total, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil(r.seq_len / block_size))] for r in reqs]
    width = max(map(len, tables))
    padded = [t + [free[0]] * (width - len(t)) for t in tables]
    query = torch.randn(sum(r.new for r in reqs), num_heads, head_dim, generator=gen).to(device, dtype)
    span_ends = [end for r in reqs for end in r.span_ends()]
    metadata = AttentionMetadata.build([r.new for r in reqs], [r.seq_len for r in reqs], padded, [-1] * len(query),
                                       torch.device(device), span_ends=span_ends)
    dense = [(cache[0, t].flatten(0, 1)[: r.seq_len], cache[1, t].flatten(0, 1)[: r.seq_len]) for r, t in zip(reqs, tables)]
    return cache, query, metadata, dense


def rule_mask(req: Req, window: int | None, spans: bool) -> torch.Tensor:
    """[new, seq_len] bool, element by element from the rule: q - window < k <= span end."""
    ends = req.span_ends() if spans else list(range(req.cached, req.seq_len))
    width = math.inf if window is None else window
    return torch.tensor([[q - width < k <= ends[i] for k in range(req.seq_len)]
                         for i, q in enumerate(range(req.cached, req.seq_len))])


def dense_attention(query, key, value, visible, scale):
    """Softmax attention of query [q, Hq, D] over key/value [k, Hkv, D] where visible [q, k], in fp32.
    Returns (out [q, Hq, D], lse [q, Hq])."""
    group = query.shape[1] // key.shape[1]
    key = key.float().cpu().repeat_interleave(group, 1)
    value = value.float().cpu().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query.float().cpu(), key) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)
    return out, torch.logsumexp(scores, -1).transpose(0, 1)


def rule_reference(reqs, query, dense, scale, window, spans):
    """Every request's new tokens under the rule: (out, lse), fp32 on CPU."""
    outs, lses, start = [], [], 0
    for req, (key, value) in zip(reqs, dense):
        out, lse = dense_attention(query[start : start + req.new], key, value, rule_mask(req, window, spans), scale)
        outs.append(out)
        lses.append(lse)
        start += req.new
    return torch.cat(outs), torch.cat(lses)


def span_ends_of(metadata: AttentionMetadata, spans: bool) -> torch.Tensor | None:
    return metadata.span_ends if spans else None


HEADS = [pytest.param(4, 2, 32, 16, id="gqa2-d32-bs16"), pytest.param(6, 2, 16, 8, id="gqa3-d16-bs8"),
         pytest.param(8, 1, 16, 16, id="gqa8-d16-bs16")]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", HEADS)
@pytest.mark.parametrize("spans", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_torch_backend_follows_the_rule(num_heads, num_kv_heads, head_dim, block_size, spans, window):
    cache, query, metadata, dense = paged_batch(BATCH, num_heads, num_kv_heads, head_dim, block_size, "cpu", torch.float32)
    scale = head_dim**-0.5
    out = TorchAttentionBackend().forward(query, cache, metadata, scale, window=window, span_ends=span_ends_of(metadata, spans))
    expected, _ = rule_reference(BATCH, query, dense, scale, window, spans)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_every_case_depends_on_its_window_and_its_spans():
    """The outputs are honest: dropping the window or the spans changes exactly the rows whose mask
    it changes (and those by a wide margin), in the PyTorch backend and so in the kernels that equal it."""
    cache, query, metadata, dense = paged_batch(BATCH, 4, 2, 32, 16, "cpu", torch.float32, seed=5)
    backend, scale = TorchAttentionBackend(), 32**-0.5
    full = backend.forward(query, cache, metadata, scale, window=8, span_ends=metadata.span_ends)
    for window, spans in [(None, True), (8, False), (None, False)]:
        reduced = backend.forward(query, cache, metadata, scale, window=window, span_ends=span_ends_of(metadata, spans))
        changed = torch.cat([(rule_mask(r, 8, True) != rule_mask(r, window, spans)).any(-1) for r in BATCH])
        diff = (full - reduced).abs().amax((1, 2))
        assert changed.any() and bool((diff[changed] > 1e-3).all()), (window, spans, diff)
        assert bool((diff[~changed] < 1e-6).all()), (window, spans)
    # both kinds of rows are there: decodes the window cuts, and span rows reaching past the window
    assert (full[0] - backend.forward(query, cache, metadata, scale)[0]).abs().max() > 1e-3


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,device,dtype,window,spans", [
    *[(*head.values, *FP32.values, w, sp) for head in HEADS
      for w, sp in [(None, False), (None, True), (4, True), (8, False), (8, True), (100, True)]],
    *[(*head.values, *FP16.values, 8, True) for head in HEADS],
    *[pytest.param(*head.values, *BF16.values, 8, True, marks=BF16.marks, id=f"{head.id}-cuda-bf16") for head in HEADS],
])
def test_triton_backend_equals_the_torch_backend(device, dtype, num_heads, num_kv_heads, head_dim, block_size, window, spans):
    """Decodes (split-KV) and prefills (paged, chunked after a cached context) in one step."""
    cache, query, metadata, dense = paged_batch(BATCH, num_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=1)
    scale, ends = head_dim**-0.5, span_ends_of(metadata, spans)
    out = TritonAttentionBackend(num_splits=2).forward(query, cache, metadata, scale, window=window, span_ends=ends)
    expected = TorchAttentionBackend().forward(query.float(), cache.float(), metadata, scale, window=window, span_ends=ends)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    ref, _ = rule_reference(BATCH, query, dense, scale, window, spans)
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


PREFILL_REQS = [
    Req(0, 9, spans=((0, 8),)),  # a whole prompt that is one picture
    Req(37, 41, spans=((40, 42), (45, 77))),  # two pictures, the second crossing several tiles and the window's edge
    Req(64, 17, spans=((70, 70),)),  # a one-token picture
    Req(5, 33),
]


@pytest.mark.parametrize("device,dtype,block_q,block_n", [(*FP32.values, 8, 16), (*FP16.values, 16, 32)])
@pytest.mark.parametrize("window", [None, 3, 16, 40])
def test_prefill_kernel_tiles_follow_the_rule(device, dtype, block_q, block_n, window):
    """The prefill kernel alone, with small tiles so that many query tiles start past whole key tiles
    (skipped) and spans reach over tile edges: output and lse against the rule."""
    cache, query, metadata, dense = paged_batch(PREFILL_REQS, 4, 2, 32, 16, device, dtype, seed=2)
    scale = 32**-0.5
    out, lse = prefill_attention(query, cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale,
                                 max_query_len=metadata.max_prefill_query_len, block_q=block_q, block_n=block_n,
                                 window=window, span_ends=metadata.span_ends)
    ref_out, ref_lse = rule_reference(PREFILL_REQS, query, dense, scale, window, True)
    torch.testing.assert_close(out.float().cpu(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=TOL[dtype] * 10, rtol=TOL[dtype])


DECODE_LENGTHS = [1, 5, 8, 9, 33, 40, 100, 300]


@pytest.mark.parametrize("device,dtype,num_splits,window", [
    (*FP32.values, 1, 8), (*FP32.values, 4, 1000), (*FP32.values, 2, None), (*FP32.values, 16, 8),
    (*FP16.values, 2, 33), (*FP16.values, 16, 33),
])
def test_split_kv_decode_with_a_window_follows_the_rule(device, dtype, num_splits, window):
    """Windows shorter and longer than the contexts; 16 splits of a short window leave some empty."""
    reqs = [Req(n - 1, 1) for n in DECODE_LENGTHS]
    cache, query, metadata, dense = paged_batch(reqs, 8, 2, 32, 16, device, dtype, seed=3)
    scale = 32**-0.5
    out, lse = decode_attention(query, cache, metadata.seq_lens, metadata.block_tables, scale, num_splits, window=window)
    ref_out, ref_lse = rule_reference(reqs, query, dense, scale, window, False)
    torch.testing.assert_close(out.float().cpu(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=TOL[dtype] * 10, rtol=TOL[dtype])
    expected = TorchAttentionBackend().forward(query.float(), cache.float(), metadata, scale, window=window)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device,dtype", [FP32, FP16])
def test_fp8_cache_with_a_window_and_spans(device, dtype):
    """The kernels cast an e4m3 cache's tiles to the query's dtype as before; the masks are the same."""
    cache, query, metadata, _ = paged_batch(BATCH, 4, 2, 32, 16, device, dtype, seed=4, cache_dtype=torch.float8_e4m3fn)
    scale = 32**-0.5
    out = TritonAttentionBackend(num_splits=2).forward(query, cache, metadata, scale, window=8, span_ends=metadata.span_ends)
    expected = TorchAttentionBackend().forward(query.float(), cache, metadata, scale, window=8, span_ends=metadata.span_ends)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


class RecordingBackend:
    """A backend that records what the layer hands it, then attends with the PyTorch reference."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[bool, int | None, torch.Tensor | None]] = []
        self.inner = TorchAttentionBackend()

    def store_kv(self, *args, **kwargs) -> None:
        self.inner.store_kv(*args, **kwargs)

    def forward(self, query, kv_cache, metadata, scale, *, window=None, span_ends=None):
        self.calls.append((metadata.cascade is not None, window, span_ends))
        return self.inner.forward(query, kv_cache, metadata, scale, window=window, span_ends=span_ends)


def bound_layer(backend, cache, **options) -> Attention:
    layer = Attention(4, 2, 32, 32**-0.5, **options)
    layer.kv_cache, layer.backend = cache, backend
    return layer


def with_a_shared_prefix(metadata: AttentionMetadata, rows: list[int], num_blocks: int, block_size: int) -> AttentionMetadata:
    """The step with `rows` sharing the first row's first `num_blocks` blocks, grouped for cascade."""
    tables = metadata.block_tables.cpu().numpy().astype(np.int64)
    tables[rows, :num_blocks] = tables[rows[0], :num_blocks]
    layout = layout_cascade([CascadeGroup(rows, num_blocks)], np.array(metadata.query_lens_cpu), np.array(metadata.seq_lens_cpu),
                            tables, block_size, tokens_per_tile(4, 2))
    device = metadata.block_tables.device
    return replace(metadata, block_tables=torch.as_tensor(tables, dtype=torch.int32).to(device),
                   cascade=CascadeMetadata.from_layout(layout, device))


SHARING_ROWS = [0, 6]  # contexts of 31 and 70 keys: both past a one-block prefix


@pytest.mark.parametrize("options,window,spans", [
    ({}, None, False),
    ({"sliding_window": 8}, 8, False),
    ({"sliding_window": 8, "bidirectional_spans": True}, 8, True),
    ({"bidirectional_spans": True}, None, True),
])
def test_the_layer_passes_its_window_and_the_steps_spans(options, window, spans):
    """A full layer stays causal (and keeps cascade); a sliding layer passes its window; a layer with
    bidirectional spans passes the step's span ends. Cascade is causal only, so a layer with either
    attends without it: the same answer as the step without groups."""
    cache, query, metadata, dense = paged_batch(BATCH, 4, 2, 32, 16, "cpu", torch.float32, seed=6)
    k = torch.zeros(len(query), 2, 32)  # stored into padding slots (-1): nothing is written
    backend = RecordingBackend()
    layer = bound_layer(backend, cache, **options)
    out = layer(query, k, k, metadata)
    expected, _ = rule_reference(BATCH, query, dense, 32**-0.5, window, spans)
    torch.testing.assert_close(out, expected.flatten(1), atol=2e-5, rtol=2e-5)
    assert backend.calls[-1][:2] == (False, window) and (backend.calls[-1][2] is metadata.span_ends) == spans

    shared = with_a_shared_prefix(metadata, SHARING_ROWS, 1, 16)
    cascaded = layer(query, k, k, shared)
    assert backend.calls[-1][0] == (window is None and not spans)
    torch.testing.assert_close(cascaded, layer(query, k, k, replace(shared, cascade=None)), atol=2e-5, rtol=2e-5)


def test_a_layer_ignores_spans_in_a_step_without_them():
    cache, query, metadata, _ = paged_batch(BATCH, 4, 2, 32, 16, "cpu", torch.float32)
    backend = RecordingBackend()
    layer = bound_layer(backend, cache, sliding_window=8, bidirectional_spans=True)
    k = torch.zeros(len(query), 2, 32)
    layer(query, k, k, replace(metadata, span_ends=None))
    assert backend.calls[-1] == (False, 8, None)


@pytest.mark.parametrize("backend", [TorchAttentionBackend(), TritonAttentionBackend()], ids=["torch", "triton"])
def test_backends_refuse_a_window_with_cascade_metadata(backend):
    cache, query, metadata, _ = paged_batch(BATCH, 4, 2, 32, 16, "cpu", torch.float32)
    with pytest.raises(ValueError, match="cascade attention is causal only"):
        backend.forward(query, cache, with_a_shared_prefix(metadata, SHARING_ROWS, 1, 16), 0.1, window=8)


def test_metadata_carries_span_ends_and_windows_are_checked():
    plain = AttentionMetadata.build([2], [2], [[0]], [0, 1], torch.device("cpu"))
    assert plain.span_ends is None
    metadata = AttentionMetadata.build([2], [2], [[0]], [0, 1], torch.device("cpu"), span_ends=[1, 1])
    assert metadata.span_ends.dtype == torch.int32 and metadata.span_ends.tolist() == [1, 1]
    assert kernel_window(None) == NO_WINDOW and kernel_window(512) == 512
    with pytest.raises(ValueError, match="sliding window"):
        kernel_window(0)
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        Attention(4, 2, 32, 0.1, sliding_window=0)


def test_warm_up_compiles_the_span_variant():
    cache = torch.zeros(2, 4, 16, 2, 32, device=KERNEL_DEVICE)  # where the kernels run: the interpreter's CPU, or the GPU
    TritonAttentionBackend().warm_up(4, 32, cache, 64, torch.float32, bidirectional_spans=True)
