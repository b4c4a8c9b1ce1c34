"""Writes the step's new K and V rows into the paged cache through a slot mapping (slot -1: skip);
into an FP8 cache divided by the layer's scales (kernels/kv_quant.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import launch_options, padded_head_dim
from mmengine.kernels.kv_quant import is_fp8, to_cache
from mmengine.kernels.e4m3 import e4m3_for_triton


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, inv_k_scale, inv_v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + token + d * 0)  # the token's slot, broadcast over the head dim
    mask = (d < HEAD_DIM) & (slot >= 0)
    slot = tl.where(slot >= 0, slot, 0)
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch + d
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
    _store_kv_kernel[(num_tokens, num_heads)](
        key, value, kv_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), FP8=is_fp8(kv_cache.dtype),
        **launch_options(),
    )
