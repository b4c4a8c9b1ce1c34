"""Shared-prefix (cascade) attention: many groups' queries against their groups' prefixes, then a
merge with each request's own attention.

Prefix pass: one program takes one tile (BLOCK_Q query tokens of one group, from any of its
requests, listed by `token_indices`) times the GROUP query heads of one KV head, and walks one
split of the group's prefix, read through a member's block table. The group's rows share every
K/V tile, so 16 decodes of one group read the prefix once instead of 16 times. Each row sees the
prefix keys up to its own position (causal inside the prefix). Long prefixes are split over
programs, like split-KV decode; each split writes a partial state (fp32 output, natural-log lse).

Fixed grids. The programs are a flat list of (tile, split) work items, and how many items, splits
and grouped tokens a step has is read on the device (`counts`): programs past them exit at once.
So a launch's grid depends only on its bounds, and a CUDA graph captured with a bucket's bounds
replays any step's groups within them.

Merge: for each grouped token (all its heads in one program; a small model's tokens several to a
program), the prefix partials and the suffix state already in (out, lse) are combined by their
log-sum-exps, in place. (merge_states.py merges two row-aligned
states; here the grouped rows are scattered over the batch and the prefix comes in several
splits, so one kernel gathers, reduces and merges in a single pass.)
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import LOG2E, dot_precision, launch_options, padded_head_dim
from mmengine.kernels.online_softmax import attend_tile, finish, load_kv_tile
from mmengine.kernels.tiling import CascadeTileMismatch, tokens_per_tile
from mmengine.kernels.e4m3 import e4m3_for_triton


# The partial states' strides follow the step's split count; unspecialized, one compiled kernel serves
# every count (warm-up compiles it once, so no split count compiles on the request path).
PARTIAL_STRIDES = ["stride_pt", "stride_ph", "stride_ps", "stride_lt", "stride_lh"]


@triton.jit(do_not_specialize=PARTIAL_STRIDES)
def _shared_prefix_kernel(
    q_ptr, cache_ptr, part_out_ptr, part_lse_ptr,
    token_indices_ptr, token_positions_ptr, group_starts_ptr, prefix_lens_ptr, group_leaders_ptr, block_tables_ptr,
    tile_groups_ptr, tile_starts_ptr, counts_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    work = tl.program_id(0)  # one (tile, split); programs past the step's work exit at once
    kv_head = tl.program_id(1)
    if work < tl.load(counts_ptr):
        num_splits = tl.load(counts_ptr + 1)
        tile = work // num_splits
        split = work % num_splits
        group = tl.load(tile_groups_ptr + tile)
        group_end = tl.load(group_starts_ptr + group + 1)
        prefix_len = tl.load(prefix_lens_ptr + group)
        leader = tl.load(group_leaders_ptr + group)
        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        entry = tl.load(tile_starts_ptr + tile) + rows // GROUP_PAD
        head_in_group = rows % GROUP_PAD
        head = kv_head * GROUP + head_in_group
        row_valid = (entry < group_end) & (head_in_group < GROUP)
        token = tl.load(token_indices_ptr + entry, mask=row_valid, other=0)
        q_pos = tl.load(token_positions_ptr + entry, mask=row_valid, other=-1)
        d = tl.arange(0, BLOCK_D)
        d_valid = d < HEAD_DIM
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_valid[:, None] & d_valid[None, :], other=0.0,
        )
        split_len = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
        # no row sees past its own position: a tile of queries inside the prefix stops early
        end = tl.minimum(tl.minimum(prefix_len, start + split_len), tl.max(q_pos, 0) + 1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(start, end, BLOCK_N):
            n = start_n + tl.arange(0, BLOCK_N)
            n_valid = n < end
            k, v = load_kv_tile(cache_ptr, block_tables_ptr, leader, n, n_valid, kv_head, d, d_valid,
                                stride_bt, stride_ckv, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            visible = n_valid[None, :] & (n[None, :] <= q_pos[:, None])
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION)
        out, lse = finish(acc, m_i, l_i)
        part = entry[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(part_out_ptr + part, out, mask=row_valid[:, None] & d_valid[None, :])
        tl.store(part_lse_ptr + entry * stride_lt + head * stride_lh + split, lse, mask=row_valid)


# Elements of the [tokens, heads, head_dim] tile one merge program holds: the tokens of a small model's layer go
# several to a program, a large one's one each.
_MERGE_TILE_ELEMENTS = 2048
_MAX_MERGE_TOKENS_PER_PROGRAM = 64


@triton.jit(do_not_specialize=PARTIAL_STRIDES)
def _merge_prefix_kernel(
    part_out_ptr, part_lse_ptr, token_indices_ptr, counts_ptr, out_ptr, lse_ptr,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh, stride_ft, stride_fh,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # grouped tokens [b * BLOCK_E, (b + 1) * BLOCK_E), all their heads; programs past the step's tokens exit
    first = tl.program_id(0) * BLOCK_E
    num_entries = tl.load(counts_ptr + 2)
    if first < num_entries:
        num_splits = tl.load(counts_ptr + 1)
        entry = first + tl.arange(0, BLOCK_E)
        live = entry < num_entries
        token = tl.load(token_indices_ptr + entry, mask=live, other=0)
        h = tl.arange(0, BLOCK_H)
        rows = live[:, None] & (h < NUM_HEADS)[None, :]  # [BLOCK_E, BLOCK_H]
        d = tl.arange(0, BLOCK_D)
        mask = rows[:, :, None] & (d < HEAD_DIM)[None, None, :]
        out_rows = token[:, None, None] * stride_ot + h[None, :, None] * stride_oh + d[None, None, :]
        lse_rows = token[:, None] * stride_ft + h[None, :] * stride_fh
        part_rows = entry[:, None] * stride_lt + h[None, :] * stride_lh
        part_out_rows = entry[:, None, None] * stride_pt + h[None, :, None] * stride_ph + d[None, None, :]
        # the suffix state, then each prefix split, folded in by an online log-sum-exp
        m = tl.load(lse_ptr + lse_rows, mask=rows, other=float("-inf"))
        weight = tl.where(m != float("-inf"), 1.0, 0.0)
        acc = tl.load(out_ptr + out_rows, mask=mask, other=0.0).to(tl.float32) * weight[:, :, None]
        for split in range(num_splits):
            lse_s = tl.load(part_lse_ptr + part_rows + split, mask=rows, other=float("-inf"))
            out_s = tl.load(part_out_ptr + part_out_rows + split * stride_ps, mask=mask, other=0.0)
            m_new = tl.maximum(m, lse_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            beta = tl.exp(lse_s - m_safe)
            weight = weight * alpha + beta
            acc = acc * alpha[:, :, None] + out_s * beta[:, :, None]
            m = m_new
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.where(weight > 0, weight, 1.0)
        tl.store(out_ptr + out_rows, (acc / total[:, :, None]).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(lse_ptr + lse_rows, tl.where(weight > 0, m_safe + tl.log(total), float("-inf")), mask=rows)


class CascadeTensors(Protocol):
    """What the prefix pass reads of a step's cascade layout (the layer's CascadeMetadata has these):
    int32 device tensors and the launch bounds, as plain attributes."""

    token_indices: torch.Tensor  # [T] grouped tokens' rows in the packed batch
    token_positions: torch.Tensor  # [T] their positions (for the causal mask)
    group_starts: torch.Tensor  # [G + 1]
    prefix_lens: torch.Tensor  # [G]
    group_leaders: torch.Tensor  # [G] a member row whose block table starts with the prefix
    tile_groups: torch.Tensor  # [N]
    tile_starts: torch.Tensor  # [N]
    counts: torch.Tensor  # [programs per KV head, splits, grouped tokens], read on the device
    tile_tokens: int  # grouped tokens per tile: must be tiling.tokens_per_tile, the kernel's BLOCK_Q
    max_work: int
    max_tokens: int
    max_splits: int


def shared_prefix_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cascade: CascadeTensors,
    block_tables: torch.Tensor,
    scale: float,
    block_n: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix pass alone. Returns partial states of the grouped tokens, in cascade order:
    out [max_tokens, q_heads, max_splits, D] fp32 and lse [max_tokens, q_heads, max_splits]
    (natural log); the first num_tokens rows and num_splits splits (cascade.counts) are written."""
    kv_cache = e4m3_for_triton(kv_cache)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if group * num_kv_heads != num_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    block_q = tokens_per_tile(num_heads, num_kv_heads)
    if cascade.tile_tokens != block_q:
        raise CascadeTileMismatch(f"the layout's tiles hold {cascade.tile_tokens} tokens, the kernel's {block_q} "
                                 f"({num_heads} query heads over {num_kv_heads} KV heads)")
    shape = (cascade.max_tokens, num_heads, max(cascade.max_splits, 1))
    part_out = torch.empty(*shape, head_dim, device=query.device, dtype=torch.float32)
    part_lse = torch.empty(shape, device=query.device, dtype=torch.float32)
    if cascade.max_work == 0:
        return part_out, part_lse
    _shared_prefix_kernel[(cascade.max_work, num_kv_heads)](
        query, kv_cache, part_out, part_lse,
        cascade.token_indices, cascade.token_positions, cascade.group_starts, cascade.prefix_lens, cascade.group_leaders,
        block_tables, cascade.tile_groups, cascade.tile_starts, cascade.counts,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
        PRECISION=dot_precision(query.dtype),
        **launch_options(),
    )
    return part_out, part_lse


def merge_prefix_states(
    out: torch.Tensor,
    lse: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    token_indices: torch.Tensor,
    counts: torch.Tensor,
    max_tokens: int | None = None,
) -> None:
    """Folds the prefix partials (cascade order) into the suffix states (out [tokens, heads, D],
    lse [tokens, heads], batch order) of the grouped tokens, in place. counts[1] (splits) and
    counts[2] (grouped tokens) are read on the device; max_tokens (default: every entry of
    token_indices) bounds them, and so the grid."""
    num_heads, head_dim = part_out.shape[1], part_out.shape[3]
    max_tokens = token_indices.shape[0] if max_tokens is None else max_tokens
    if max_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_heads), padded_head_dim(head_dim)
    block_e = max(1, min(_MAX_MERGE_TOKENS_PER_PROGRAM, _MERGE_TILE_ELEMENTS // (block_h * block_d)))
    _merge_prefix_kernel[(triton.cdiv(max_tokens, block_e),)](
        part_out, part_lse, token_indices, counts, out, lse,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        NUM_HEADS=num_heads, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_E=block_e,
        **launch_options(),
    )


def cascade_prefix_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cascade: CascadeTensors,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """The prefix pass and the merge: (out, lse) hold every token's suffix state on entry and its
    whole attention on return."""
    part_out, part_lse = shared_prefix_attention(query, kv_cache, cascade, block_tables, scale)
    merge_prefix_states(out, lse, part_out, part_lse, cascade.token_indices, cascade.counts, cascade.max_tokens)
