"""Merges two partial attention states over disjoint key sets through their log-sum-exps.

(out_a, lse_a) and (out_b, lse_b), out [tokens, heads, D], lse [tokens, heads] in natural log.
A side with lse = -inf (no keys) contributes nothing; both empty gives out 0, lse -inf.
This is the building block for shared-prefix (cascade) attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import launch_options, padded_head_dim


@triton.jit
def _merge_kernel(
    a_ptr, lse_a_ptr, b_ptr, lse_b_ptr, out_ptr, lse_ptr,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh, stride_lt, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    lse_a = tl.load(lse_a_ptr + token * stride_lt + head * stride_lh)
    lse_b = tl.load(lse_b_ptr + token * stride_lt + head * stride_lh)
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    total = w_a + w_b
    a = tl.load(a_ptr + token * stride_at + head * stride_ah + d, mask=d_valid, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + token * stride_bt + head * stride_bh + d, mask=d_valid, other=0.0).to(tl.float32)
    out = (a * w_a + b * w_b) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_valid)
    tl.store(lse_ptr + token * stride_lt + head * stride_lh, tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf")))


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = out_a.shape
    assert lse_a.shape == lse_b.shape == (num_tokens, num_heads) and lse_a.stride() == lse_b.stride()
    out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    if num_tokens == 0:
        return out, lse
    _merge_kernel[(num_tokens, num_heads)](
        out_a, lse_a, out_b, lse_b, out, lse,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_a.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
        **launch_options(),
    )
    return out, lse
