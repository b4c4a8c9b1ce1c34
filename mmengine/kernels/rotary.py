"""Rotary embedding of q and k in one launch, reading the cos/sin table by position, and (given a
paged cache) the rotated k and the v of each token written to its slot (slot -1: skip).

Layout (GPT-NeoX): the first and second halves of a head rotate together. The table row of a
position is [cos(cat(f, f)) | sin(cat(f, f))] (2 * head_dim values, see mmengine.layers.rotary).
Numerics follow transformers' `x * cos + rotate_half(x) * sin` in the model dtype: cos and sin are
rounded to q's dtype, and each product and the sum are rounded to it, computed in float32.

M-RoPE: positions are [tokens, 3] and frequency j is read at position channel 0 for j < S0, channel 1
for S0 <= j < S0 + S1, else channel 2 (plain RoPE is the case S0 = head_dim / 2 with one channel).
Interleaved (Qwen3-VL): channel 1 where j % 3 == 1 and j < 3 * S1, channel 2 where j % 3 == 2 and
j < 3 * S2, else channel 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.checks import check_positions
from mmengine.kernels.common import launch_options
from mmengine.kernels.kv_quant import is_fp8, to_cache
from mmengine.kernels.e4m3 import e4m3_for_triton

# Elements of one [heads, head_dim / 2] tile a program holds at a time (keeps registers bounded).
_TILE_ELEMENTS = 2048


@triton.jit
def _rotate_heads(x_ptr, stride_xh, heads, head_mask, j, j_mask, c1, c2, s1, s2, HALF: tl.constexpr):
    """Rotates the rows `heads` of one token (x_ptr) in place; returns the two rotated halves."""
    dtype = x_ptr.dtype.element_ty
    mask = head_mask[:, None] & j_mask[None, :]
    first = x_ptr + heads[:, None] * stride_xh + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # Each product and the sum rounded to the model dtype, as transformers computes in that dtype.
    o1 = ((x1 * c1[None, :]).to(dtype).to(tl.float32) - (x2 * s1[None, :]).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c2[None, :]).to(dtype).to(tl.float32) + (x1 * s2[None, :]).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first, o1, mask=mask)
    tl.store(first + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, cache_ptr, slot_ptr, inv_k_scale, inv_v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pos_row,
    stride_pos_token, stride_pos_channel,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, STORE_KV: tl.constexpr, SECTION_0: tl.constexpr, SECTION_1: tl.constexpr,
    SECTION_2: tl.constexpr, INTERLEAVED: tl.constexpr, FP8: tl.constexpr,
):
    """Grid (tokens, 2): program (t, 0) rotates token t's query heads, (t, 1) its key heads and,
    with STORE_KV, writes its rotated keys and its values into the cache."""
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    token_pos = pos_ptr + token * stride_pos_token
    pos = tl.load(token_pos).to(tl.int64)
    if SECTION_0 < HALF:  # M-RoPE: each frequency at its own channel's position
        pos_h = tl.load(token_pos + stride_pos_channel).to(tl.int64)
        pos_w = tl.load(token_pos + 2 * stride_pos_channel).to(tl.int64)
        if INTERLEAVED:
            pos = tl.where((j % 3 == 1) & (j < 3 * SECTION_1), pos_h, tl.where((j % 3 == 2) & (j < 3 * SECTION_2), pos_w, pos))
        else:
            pos = tl.where(j < SECTION_0, pos, tl.where(j < SECTION_0 + SECTION_1, pos_h, pos_w))
    row = cos_sin_ptr + pos * stride_pos_row
    c1 = tl.load(row + j, mask=j_mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(row + HALF + j, mask=j_mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(row + HEAD_DIM + j, mask=j_mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(row + HEAD_DIM + HALF + j, mask=j_mask, other=0.0).to(dtype).to(tl.float32)
    tile = tl.arange(0, HEADS_PER_TILE)
    if tl.program_id(1) == 0:
        for h0 in tl.static_range(0, NUM_HEADS, HEADS_PER_TILE):
            heads = h0 + tile
            _rotate_heads(q_ptr + token * stride_qt, stride_qh, heads, heads < NUM_HEADS, j, j_mask, c1, c2, s1, s2, HALF)
    else:
        # The token's slot, broadcast over a tile of heads (without STORE_KV a dummy: nothing is stored).
        slot = tl.load(slot_ptr + token + tile * 0)
        stored = slot >= 0
        slot = tl.where(stored, slot, 0)
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs  # [HEADS_PER_TILE]
        d = tl.arange(0, BLOCK_D)
        for h0 in tl.static_range(0, NUM_KV_HEADS, HEADS_PER_TILE):
            heads = h0 + tile
            head_mask = heads < NUM_KV_HEADS
            o1, o2 = _rotate_heads(k_ptr + token * stride_kt, stride_kh, heads, head_mask, j, j_mask, c1, c2, s1, s2, HALF)
            if STORE_KV:
                cache_dtype = cache_ptr.dtype.element_ty
                row_mask = head_mask & stored
                k_mask = row_mask[:, None] & j_mask[None, :]
                k_dst = dst[:, None] + heads[:, None] * stride_ch + j[None, :]
                tl.store(k_dst, to_cache(o1, inv_k_scale, cache_dtype, FP8), mask=k_mask)
                tl.store(k_dst + HALF, to_cache(o2, inv_k_scale, cache_dtype, FP8), mask=k_mask)
                v_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
                v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=v_mask)
                v_dst = dst[:, None] + stride_ckv + heads[:, None] * stride_ch + d[None, :]
                tl.store(v_dst, to_cache(v, inv_v_scale, cache_dtype, FP8), mask=v_mask)


def _heads_per_tile(num_heads: int, block_half: int) -> int:
    return min(triton.next_power_of_2(num_heads), max(1, _TILE_ELEMENTS // block_half))


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    mrope_section: tuple[int, ...] | None = None,
    mrope_interleaved: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place by the table rows of `positions` [T] (or
    [T, 3] with `mrope_section`, laid out as `mrope_interleaved` says: see the module docstring); with a
    kv_cache [2, blocks, block_size, Hkv, D], also writes the rotated k and v [T, Hkv, D] to each
    token's slot in `slot_mapping` [T] (-1: skip), into an FP8 cache divided by k_scale / v_scale.
    q/k/v may be strided views (e.g. of one fused QKV output) whose last dim is contiguous. Positions
    must lie in [0, len(cos_sin)); they are checked only for CPU tensors (the check would sync a GPU)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or k.shape != (num_tokens, num_kv_heads, head_dim) or cos_sin.shape[1] != 2 * head_dim:
        raise ValueError(f"rotary shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, table {tuple(cos_sin.shape)}")
    store = kv_cache is not None
    if store and (v is None or slot_mapping is None or v.shape != k.shape):
        raise ValueError("storing K/V needs v shaped like k and a slot mapping")
    if num_tokens == 0:
        return
    if positions.device.type == "cpu":
        check_positions(positions, cos_sin.shape[0])
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    if store:
        kv_cache = e4m3_for_triton(kv_cache)
        assert v.stride(-1) == 1 and kv_cache.stride(-1) == 1
    half = head_dim // 2
    if mrope_section is not None:
        if positions.dim() != 2 or positions.shape[1] != 3 or len(mrope_section) != 3 or sum(mrope_section) != half:
            raise ValueError(f"M-RoPE needs positions [T, 3] and 3 sections summing to {half}: {tuple(positions.shape)}, {mrope_section}")
        sections, pos_strides = tuple(int(n) for n in mrope_section), (positions.stride(0), positions.stride(1))
    else:
        sections, pos_strides = (half, 0, 0), (positions.stride(0), 0)
    block_half = triton.next_power_of_2(half)
    heads_per_tile = _heads_per_tile(max(num_heads, num_kv_heads), block_half)
    num_warps = min(8, max(1, heads_per_tile * block_half // 256))
    cache_arg = kv_cache if store else q  # unused pointers when not storing
    v_arg = v if store else k
    _rotary_kv_kernel[(num_tokens, 2)](
        q, k, v_arg, positions, cos_sin, cache_arg, slot_mapping if store else positions, 1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_arg.stride(0), v_arg.stride(1), cos_sin.stride(0),
        *pos_strides,
        *(kv_cache.stride()[:4] if store else (0, 0, 0, 0)),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HALF=block_half, BLOCK_D=triton.next_power_of_2(head_dim), HEADS_PER_TILE=heads_per_tile,
        BLOCK_SIZE=kv_cache.shape[2] if store else 1, STORE_KV=store, SECTION_0=sections[0], SECTION_1=sections[1],
        SECTION_2=sections[2], INTERLEAVED=bool(mrope_interleaved) and mrope_section is not None,
        FP8=store and is_fp8(kv_cache.dtype),
        **launch_options(num_warps=num_warps, num_stages=1),
    )
