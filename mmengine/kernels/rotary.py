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

# Elements of one [tokens, heads, head_dim / 2] tile a program holds at a time (keeps registers bounded).
_TILE_ELEMENTS = 2048
# Tokens one program takes at most, where a token's heads fill only part of a tile (small heads or few of them).
_MAX_TOKENS_PER_PROGRAM = 64


@triton.jit
def _rotate_heads(x_ptr, stride_xt, stride_xh, tokens, token_mask, heads, head_mask, j, j_mask, c1, c2, s1, s2,
                  HALF: tl.constexpr):
    """Rotates the rows `heads` of the tokens `tokens` in place (c1..s2: [tokens, j]); returns the two rotated
    halves [tokens, heads, j]."""
    dtype = x_ptr.dtype.element_ty
    mask = token_mask[:, None, None] & head_mask[None, :, None] & j_mask[None, None, :]
    first = x_ptr + tokens[:, None, None] * stride_xt + heads[None, :, None] * stride_xh + j[None, None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    c1, c2, s1, s2 = c1[:, None, :], c2[:, None, :], s1[:, None, :], s2[:, None, :]
    # Each product and the sum rounded to the model dtype, as transformers computes in that dtype.
    o1 = ((x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first, o1, mask=mask)
    tl.store(first + HALF, o2, mask=mask)
    return o1, o2


@triton.jit(do_not_specialize=["num_tokens"])
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, cache_ptr, slot_ptr, inv_k_scale, inv_v_scale, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pos_row,
    stride_pos_token, stride_pos_channel,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_TILE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, STORE_KV: tl.constexpr, SECTION_0: tl.constexpr, SECTION_1: tl.constexpr,
    SECTION_2: tl.constexpr, INTERLEAVED: tl.constexpr, FP8: tl.constexpr,
):
    """Grid (cdiv(tokens, BLOCK_T), 2): program (b, 0) rotates the query heads of tokens [b * BLOCK_T, (b + 1) *
    BLOCK_T), (b, 1) their key heads and, with STORE_KV, writes their rotated keys and their values into the cache."""
    HALF: tl.constexpr = HEAD_DIM // 2
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    token_pos = pos_ptr + tokens * stride_pos_token
    pos = tl.load(token_pos, mask=token_mask, other=0).to(tl.int64)[:, None]  # [BLOCK_T, 1]
    if SECTION_0 < HALF:  # M-RoPE: each frequency at its own channel's position
        pos_h = tl.load(token_pos + stride_pos_channel, mask=token_mask, other=0).to(tl.int64)[:, None]
        pos_w = tl.load(token_pos + 2 * stride_pos_channel, mask=token_mask, other=0).to(tl.int64)[:, None]
        if INTERLEAVED:
            at_h = ((j % 3 == 1) & (j < 3 * SECTION_1))[None, :]
            at_w = ((j % 3 == 2) & (j < 3 * SECTION_2))[None, :]
            pos = tl.where(at_h, pos_h, tl.where(at_w, pos_w, pos))
        else:
            pos = tl.where((j < SECTION_0)[None, :], pos, tl.where((j < SECTION_0 + SECTION_1)[None, :], pos_h, pos_w))
    row = cos_sin_ptr + pos * stride_pos_row + j[None, :]  # [BLOCK_T, BLOCK_HALF]
    row_mask = token_mask[:, None] & j_mask[None, :]
    dtype = q_ptr.dtype.element_ty
    c1 = tl.load(row, mask=row_mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(row + HALF, mask=row_mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(row + HEAD_DIM, mask=row_mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(row + HEAD_DIM + HALF, mask=row_mask, other=0.0).to(dtype).to(tl.float32)
    tile = tl.arange(0, HEADS_PER_TILE)
    if tl.program_id(1) == 0:
        for h0 in tl.static_range(0, NUM_HEADS, HEADS_PER_TILE):
            heads = h0 + tile
            _rotate_heads(q_ptr, stride_qt, stride_qh, tokens, token_mask, heads, heads < NUM_HEADS, j, j_mask,
                          c1, c2, s1, s2, HALF)
    else:
        # Each token's slot (-1, and tokens past the last: nothing stored; without STORE_KV a dummy).
        slot = tl.load(slot_ptr + tokens, mask=token_mask, other=-1)
        stored = slot >= 0
        slot = tl.where(stored, slot, 0)
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs  # [BLOCK_T]
        d = tl.arange(0, BLOCK_D)
        for h0 in tl.static_range(0, NUM_KV_HEADS, HEADS_PER_TILE):
            heads = h0 + tile
            head_mask = heads < NUM_KV_HEADS
            o1, o2 = _rotate_heads(k_ptr, stride_kt, stride_kh, tokens, token_mask, heads, head_mask, j, j_mask,
                                   c1, c2, s1, s2, HALF)
            if STORE_KV:
                cache_dtype = cache_ptr.dtype.element_ty
                rows_mask = stored[:, None] & head_mask[None, :]  # [BLOCK_T, HEADS_PER_TILE]
                k_mask = rows_mask[:, :, None] & j_mask[None, None, :]
                rows_dst = dst[:, None] + heads[None, :] * stride_ch
                k_dst = rows_dst[:, :, None] + j[None, None, :]
                tl.store(k_dst, to_cache(o1, inv_k_scale, cache_dtype, FP8), mask=k_mask)
                tl.store(k_dst + HALF, to_cache(o2, inv_k_scale, cache_dtype, FP8), mask=k_mask)
                v_mask = rows_mask[:, :, None] & (d < HEAD_DIM)[None, None, :]
                v_src = v_ptr + tokens[:, None, None] * stride_vt + heads[None, :, None] * stride_vh + d[None, None, :]
                v = tl.load(v_src, mask=v_mask)
                tl.store(rows_dst[:, :, None] + stride_ckv + d[None, None, :], to_cache(v, inv_v_scale, cache_dtype, FP8),
                         mask=v_mask)


def rotary_tiles(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(heads per tile, tokens per program): a tile holds all of a token's heads where they fit in
    _TILE_ELEMENTS, and then as many tokens as fit with them (a constant of the layer's shape, never of a
    step's token count, so every step launches the kernel warm-up compiled)."""
    block_half = triton.next_power_of_2(head_dim // 2)
    heads_per_tile = min(triton.next_power_of_2(max(num_heads, num_kv_heads)), max(1, _TILE_ELEMENTS // block_half))
    tokens = max(1, min(_MAX_TOKENS_PER_PROGRAM, _TILE_ELEMENTS // (heads_per_tile * block_half)))
    return heads_per_tile, tokens


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
    heads_per_tile, block_t = rotary_tiles(num_heads, num_kv_heads, head_dim)
    num_warps = min(8, max(1, block_t * heads_per_tile * block_half // 256))
    cache_arg = kv_cache if store else q  # unused pointers when not storing
    v_arg = v if store else k
    _rotary_kv_kernel[(triton.cdiv(num_tokens, block_t), 2)](
        q, k, v_arg, positions, cos_sin, cache_arg, slot_mapping if store else positions, 1.0 / k_scale, 1.0 / v_scale,
        num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_arg.stride(0), v_arg.stride(1), cos_sin.stride(0),
        *pos_strides,
        *(kv_cache.stride()[:4] if store else (0, 0, 0, 0)),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HALF=block_half, BLOCK_D=triton.next_power_of_2(head_dim), HEADS_PER_TILE=heads_per_tile, BLOCK_T=block_t,
        BLOCK_SIZE=kv_cache.shape[2] if store else 1, STORE_KV=store, SECTION_0=sections[0], SECTION_1=sections[1],
        SECTION_2=sections[2], INTERLEAVED=bool(mrope_interleaved) and mrope_section is not None,
        FP8=store and is_fp8(kv_cache.dtype),
        **launch_options(num_warps=num_warps, num_stages=1),
    )
