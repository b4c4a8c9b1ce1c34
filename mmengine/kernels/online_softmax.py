"""Pieces shared by the attention kernels: reading a K/V tile through a block table, the online
softmax update over one tile, and turning the running state into (output, natural-log lse)."""

from __future__ import annotations

import triton
import triton.language as tl

from mmengine.kernels.e4m3 import e4m3_bits_to_float


@triton.jit
def load_kv_tile(
    cache_ptr, block_tables_ptr, req, n, n_valid, kv_head, d, d_valid,
    stride_bt, stride_ckv, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr,
):
    """K and V [len(n), BLOCK_D] of one KV head at key positions n of request req."""
    block = tl.load(block_tables_ptr + req * stride_bt + n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)  # offsets can pass 2**31 elements
    offsets = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    mask = n_valid[:, None] & d_valid[None, :]
    if tl.constexpr(cache_ptr.dtype.element_ty == tl.uint8):  # an FP8 cache's bits, where Triton has no e4m3 type
        k = e4m3_bits_to_float(tl.load(cache_ptr + offsets[:, None] + d[None, :], mask=mask, other=0))
        v = e4m3_bits_to_float(tl.load(cache_ptr + stride_ckv + offsets[:, None] + d[None, :], mask=mask, other=0))
    else:
        k = tl.load(cache_ptr + offsets[:, None] + d[None, :], mask=mask, other=0.0)
        v = tl.load(cache_ptr + stride_ckv + offsets[:, None] + d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One online-softmax step (base 2, scores pre-scaled by log2(e)) over the visible keys of a tile.
    K/V of an FP8 cache are cast to q's dtype (exactly); their scales are applied by the caller."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def finish(acc, m_i, l_i):
    """Normalized output and natural-log lse; a row that saw no key gives output 0 and lse -inf."""
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return out, lse
