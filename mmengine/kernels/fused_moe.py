"""Fused mixture-of-experts MLP: every (token, chosen expert) pair through its expert in two grouped GEMMs.

1. `align_by_expert` sorts the T x k pairs by expert and pads each expert's run to a multiple of
   BLOCK_M (vLLM's moe_align_block_size): one BLOCK_M tile of sorted rows then belongs to one expert.
   The padded layout has a fixed upper size (T x k + experts x (BLOCK_M - 1) rows), so nothing here
   reads a count back to the host: a step stays free of syncs and a CUDA graph can replay it.
2. `_gate_up_kernel`: per tile, x[token] @ gate_up[expert].T for the gate and the up halves, then
   act(gate) * up (SiLU, or GELU's tanh approximation: Gemma 4's experts), stored per pair.
3. `_down_kernel`: per tile, that @ down[expert].T times the pair's routing weight, stored per pair;
   the k pairs of a token are then summed (a fixed order: no atomics, deterministic).
Tiles past the padded count, rows of padding and experts that got no token cost nothing but a check.
Quantized experts are dequantized in registers to the activations' dtype, as the weight GEMMs do: FP8
(e4m3 weights with scales laid out as kernels/fp8_gemm.py's, per expert) and int4 (kernels/w4a16.py's
packing per expert: qweight [experts, inputs / 8, outputs], scales and zeros [experts, groups, outputs]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import K_TILE_BYTES, GemmTiles, dot_precision, fit_gemm_tiles, launch_options, shared_memory_limit
from mmengine.kernels.e4m3 import e4m3_for_triton
from mmengine.kernels.fp8_gemm import load_fp8_tile
from mmengine.kernels.w4a16 import load_int4_tile

BLOCK_M = 16
# How the experts' weights are stored (the kernels' WEIGHTS constexpr)
DENSE, FP8, INT4 = 0, 1, 2
# The gate's activation (the ACTIVATION constexpr), by transformers' name
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M,
                    skip_past_end: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (sorted_pairs [capacity]: flat pair indices t * k + j grouped by expert, each group
    padded to a multiple of block_m with T * k; tile_expert [capacity / block_m]: the expert of each tile
    (-1 past the end); num_padded [1]: rows in use). `skip_past_end`: ids may be `num_experts` (a pair whose
    expert another rank holds: expert parallelism), grouped last, past the rows in use, so no tile computes them."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    groups = num_experts + 1 if skip_past_end else num_experts
    capacity = triton.cdiv(num_pairs + groups * (block_m - 1), block_m) * block_m
    counts = torch.zeros(groups, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))  # (bincount syncs)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, in token order within one
    sorted_experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - first_of_expert[sorted_experts]
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.long, device=flat.device)
    sorted_pairs[starts[sorted_experts] + rank] = order
    tile_starts = torch.arange(0, capacity, block_m, device=flat.device)
    tile_expert = torch.searchsorted(ends, tile_starts, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1)
    return sorted_pairs, tile_expert, ends[num_experts - 1 : num_experts]  # (the skipped group's rows are past it)


@triton.jit
def _tile_pairs(sorted_ptr, tile_expert_ptr, tile, num_pairs, BLOCK_M: tl.constexpr):
    """A tile's expert, its BLOCK_M sorted pair indices, and which of them are real (not padding)."""
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    pairs = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs


@triton.jit
def _expert_weights(w_ptr, s_ptr, z_ptr, expert, stride_we, stride_se):
    """An expert's weights, scales and zero points (the zeros laid out as the scales)."""
    return w_ptr + expert * stride_we, s_ptr + expert * stride_se, z_ptr + expert * stride_se


@triton.jit
def _load_weight_tile(w, s, z, cols, ks, mask, stride_w, stride_s, group_k, dtype, WEIGHTS: tl.constexpr):
    """An expert's weight tile W^T [BLOCK_K, BLOCK_N] in `dtype`: dense W [N, K]; FP8 W [N, K] with scales
    [N, K / group]; int4 qweight [K / 8, N] with scales and zeros [K / group, N]."""
    # One return after if/elif/else: the compiler type-checks every return it reaches, and an early return
    # under a constexpr `if` does not stop it reaching the fall-through one (of another dtype).
    if WEIGHTS == 2:
        tile = load_int4_tile(w, s, z, ks, cols, ks // group_k, mask, stride_w, stride_s, dtype)
    elif WEIGHTS == 1:
        tile = load_fp8_tile(w, s, ks, cols, mask, stride_w, stride_s, group_k, dtype)
    else:
        tile = tl.load(w + cols[None, :] * stride_w + ks[:, None], mask=mask, other=0.0).to(dtype)
    return tile


@triton.jit
def _activate(gate, ACTIVATION: tl.constexpr):
    """silu(gate), or gelu(gate) by its tanh approximation (tanh(z) = 1 - 2 / (1 + e^2z)), in fp32."""
    if ACTIVATION == 1:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
    else:
        out = gate / (1.0 + tl.exp(-gate))
    return out


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, sorted_ptr, tile_expert_ptr, num_padded_ptr,
    num_pairs, top_k, hidden, inter, group_k,
    stride_x, stride_we, stride_w, stride_se, stride_s, stride_out,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHTS: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, pairs, row_ok = _tile_pairs(sorted_ptr, tile_expert_ptr, tile, num_pairs, BLOCK_M)
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w, s, z = _expert_weights(w_ptr, s_ptr, z_ptr, expert, stride_we, stride_se)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        mask = col_ok[None, :] & k_ok[:, None]
        wg = _load_weight_tile(w, s, z, cols, ks, mask, stride_w, stride_s, group_k, a.dtype, WEIGHTS)
        wu = _load_weight_tile(w, s, z, inter + cols, ks, mask, stride_w, stride_s, group_k, a.dtype, WEIGHTS)
        gate = tl.dot(a, wg, gate, input_precision=PRECISION)
        up = tl.dot(a, wu, up, input_precision=PRECISION)
    act = _activate(gate, ACTIVATION) * up
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :], act.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, z_ptr, out_ptr, weight_ptr, sorted_ptr, tile_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter, group_k,
    stride_h, stride_we, stride_w, stride_se, stride_s, stride_out,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHTS: tl.constexpr,
):
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, pairs, row_ok = _tile_pairs(sorted_ptr, tile_expert_ptr, tile, num_pairs, BLOCK_M)
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w, s, z = _expert_weights(w_ptr, s_ptr, z_ptr, expert, stride_we, stride_se)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = _load_weight_tile(w, s, z, cols, ks, col_ok[None, :] & k_ok[:, None], stride_w, stride_s, group_k, a.dtype, WEIGHTS)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    routing = tl.load(weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * routing[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def moe_tiles(n: int, k: int, act_bytes: int, weight_bytes: int, limit: int, weight_tiles: int) -> GemmTiles:
    """One grouped GEMM's launch configuration: BLOCK_M pairs by [k] inputs (`act_bytes` an element) @
    `weight_tiles` weight tiles [k, n] (2 for gate and up), the kernel loading `weight_bytes` per weight
    element, within `limit` bytes of shared memory."""
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(K_TILE_BYTES // act_bytes, triton.next_power_of_2(k)))
    return fit_gemm_tiles(BLOCK_M, block_n, block_k, 2, act_bytes, weight_bytes, limit, weight_tiles)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              gate_up_scales: torch.Tensor | None = None, down_scales: torch.Tensor | None = None, group_k: int = 0,
              gate_up_zeros: torch.Tensor | None = None, down_zeros: torch.Tensor | None = None,
              activation: str = "silu", skip_past_end: bool = False) -> torch.Tensor:
    """sum_j weights[t, j] * down[e] @ act(gate_up[e, :I] @ x[t]) * (gate_up[e, I:] @ x[t]), e = experts[t, j],
    act one of ACTIVATIONS.
    x [T, H], gate_up [E, 2I, H], down [E, H, I], weights / experts [T, k] -> [T, H] in x's dtype.
    FP8 experts (scales, no zeros): gate_up and down in e4m3 with fp32 scales [E, 2I, ceil(H / group_k)] and
    [E, H, ceil(I / group_k)]. Int4 experts (scales and zeros): gate_up int32 [E, H / 8, 2I] and down
    [E, I / 8, H], scales and zeros [E, ceil(H / group_k), 2I] and [E, ceil(I / group_k), H].
    `skip_past_end` (expert parallelism): an id E is a pair whose expert this rank does not hold; it adds zero."""
    num_tokens, hidden = x.shape
    layout = _check_layout(hidden, gate_up, down, gate_up_scales, down_scales, group_k, gate_up_zeros, down_zeros)
    num_experts, inter = gate_up.shape[0], (gate_up.shape[2] if layout == INT4 else gate_up.shape[1]) // 2
    top_k = experts.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and down.stride(-1) == 1
    if layout == FP8:
        gate_up, down = e4m3_for_triton(gate_up), e4m3_for_triton(down)
    # unused pointers where the layout has no scales or zeros
    gate_up_s, down_s = (gate_up_scales, down_scales) if layout != DENSE else (gate_up, down)
    gate_up_z, down_z = (gate_up_zeros, down_zeros) if layout == INT4 else (gate_up_s, down_s)
    assert gate_up_z.stride() == gate_up_s.stride() and down_z.stride() == down_s.stride()
    sorted_pairs, tile_expert, num_padded = align_by_expert(experts, num_experts, skip_past_end=skip_past_end)
    num_pairs = num_tokens * top_k
    num_tiles = tile_expert.shape[0]
    precision = dot_precision(x.dtype)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    limit, act_bytes = shared_memory_limit(x.device), x.element_size()
    tiles = moe_tiles(inter, hidden, act_bytes, _weight_bytes(layout, gate_up, gate_up_s, gate_up_z), limit, weight_tiles=2)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, tiles.block_n))](
        x, gate_up, gate_up_s, gate_up_z, h, sorted_pairs, tile_expert, num_padded, num_pairs, top_k, hidden, inter, max(group_k, 1),
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_s.stride(0), gate_up_s.stride(1), h.stride(0),
        PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, WEIGHTS=layout,
        ACTIVATION=ACTIVATIONS[activation], **launch_options(num_stages=tiles.num_stages),
    )
    # (a skipped pair's row is never stored: zeros)
    per_pair = (torch.zeros if skip_past_end else torch.empty)(num_pairs, hidden, dtype=x.dtype, device=x.device)
    tiles = moe_tiles(hidden, inter, act_bytes, _weight_bytes(layout, down, down_s, down_z), limit, weight_tiles=1)
    _down_kernel[(num_tiles, triton.cdiv(hidden, tiles.block_n))](
        h, down, down_s, down_z, per_pair, weights.reshape(-1).contiguous(), sorted_pairs, tile_expert, num_padded, num_pairs, hidden,
        inter, max(group_k, 1), h.stride(0), down.stride(0), down.stride(1), down_s.stride(0), down_s.stride(1), per_pair.stride(0),
        PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, WEIGHTS=layout,
        **launch_options(num_stages=tiles.num_stages),
    )
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype) if top_k > 1 else per_pair


def _weight_bytes(layout: int, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> int:
    """Bytes `_load_weight_tile` reads per weight element: the weight (an int4 tile reads each packed word
    once per nibble), and in FP8 a scale, in int4 a scale and a zero point."""
    if layout == INT4:
        return weight.element_size() + scales.element_size() + zeros.element_size()
    if layout == FP8:
        return weight.element_size() + scales.element_size()
    return weight.element_size()


def _check_layout(hidden: int, gate_up: torch.Tensor, down: torch.Tensor, gate_up_scales: torch.Tensor | None,
                  down_scales: torch.Tensor | None, group_k: int, gate_up_zeros: torch.Tensor | None,
                  down_zeros: torch.Tensor | None) -> int:
    """DENSE, FP8 or INT4, from which of scales and zeros are given; raises where they do not cover the weights."""
    if gate_up_scales is None and down_scales is None and gate_up_zeros is None and down_zeros is None:
        return DENSE
    num_experts = gate_up.shape[0]
    int4 = gate_up_zeros is not None or down_zeros is not None
    if int4:
        inter = gate_up.shape[2] // 2
        groups = -(-hidden // max(group_k, 1)), -(-inter // max(group_k, 1))
        ok = (gate_up.dtype == down.dtype == torch.int32 and hidden % 8 == 0 and inter % 8 == 0 and group_k % 8 == 0
              and gate_up.shape == (num_experts, hidden // 8, 2 * inter) and down.shape == (num_experts, inter // 8, hidden)
              and all(t is not None for t in (gate_up_scales, down_scales, gate_up_zeros, down_zeros))
              and gate_up_scales.shape == gate_up_zeros.shape == (num_experts, groups[0], 2 * inter)
              and down_scales.shape == down_zeros.shape == (num_experts, groups[1], hidden))
    else:
        inter = gate_up.shape[1] // 2
        ok = (gate_up_scales is not None and down_scales is not None and gate_up_scales.shape == (num_experts, 2 * inter, -(-hidden // max(group_k, 1)))
              and down_scales.shape == (num_experts, hidden, -(-inter // max(group_k, 1))))
    if not ok:
        shapes = {name: None if t is None else tuple(t.shape) for name, t in (("gate_up", gate_up), ("down", down),
                  ("gate_up_scales", gate_up_scales), ("down_scales", down_scales), ("gate_up_zeros", gate_up_zeros),
                  ("down_zeros", down_zeros))}
        raise ValueError(f"{'int4' if int4 else 'FP8'} expert weights and scales {shapes} do not cover {hidden} inputs "
                         f"in groups of {group_k}")
    return INT4 if int4 else FP8
