"""Writes the step's new K and V rows into the paged cache through a slot mapping (slot -1: skip);
into an FP8 cache divided by the layer's scales (kernels/kv_quant.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import launch_options, padded_head_dim
from mmengine.kernels.kv_quant import is_fp8, to_cache
from mmengine.kernels.e4m3 import e4m3_for_triton


# Elements of the [rows, head_dim] tile one program stores; a row is one (token, KV head).
_TILE_ELEMENTS = 2048
_MAX_ROWS_PER_PROGRAM = 64


@triton.jit(do_not_specialize=["num_rows"])
def _store_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, inv_k_scale, inv_v_scale, num_rows,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, FP8: tl.constexpr,
):
    """Rows (token * NUM_HEADS + head) [b * BLOCK_ROWS, (b + 1) * BLOCK_ROWS) in program b."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token = rows // NUM_HEADS
    head = rows % NUM_HEADS
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + token, mask=rows < num_rows, other=-1)
    mask = (slot >= 0)[:, None] & (d < HEAD_DIM)[None, :]
    slot = tl.where(slot >= 0, slot, 0)
    k = tl.load(key_ptr + (token * stride_kt + head * stride_kh)[:, None] + d[None, :], mask=mask)
    v = tl.load(value_ptr + (token * stride_vt + head * stride_vh)[:, None] + d[None, :], mask=mask)
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch)[:, None] + d[None, :]
    cache_dtype = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + dst, to_cache(k, inv_k_scale, cache_dtype, FP8), mask=mask)
    tl.store(cache_ptr + stride_ckv + dst, to_cache(v, inv_v_scale, cache_dtype, FP8), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key/value [tokens, kv_heads, head_dim]; kv_cache [2, blocks, block_size, kv_heads, head_dim]; the
    scales apply to an FP8 cache only."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kv_cache = e4m3_for_triton(kv_cache)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    block_d = padded_head_dim(head_dim)
    block_rows = max(1, min(_MAX_ROWS_PER_PROGRAM, _TILE_ELEMENTS // block_d))
    num_rows = num_tokens * num_heads
    _store_kv_kernel[(triton.cdiv(num_rows, block_rows),)](
        key, value, kv_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale, num_rows,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_ROWS=block_rows, FP8=is_fp8(kv_cache.dtype),
        **launch_options(),
    )
