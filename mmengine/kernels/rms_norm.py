"""RMSNorm over rows, alone or fused with the residual add before it (one read of x and the
residual, one write of the normed row and the new residual).

Numerics follow transformers' Llama RMSNorm: the residual add rounded to the model dtype; the
mean of squares and the normalisation in float32; the normalised row rounded to the model dtype,
then multiplied by the weight and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import launch_options


# Elements a program holds at most; rows shorter than that are taken several to a program.
_TILE_ELEMENTS = 4096
_MAX_ROWS_PER_PROGRAM = 64


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, eps, num_rows,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """Rows [b * BLOCK_ROWS, (b + 1) * BLOCK_ROWS) in program b."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)
        tl.store(residual_out_ptr + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=1) / N
    rstd = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))  # correctly rounded, like torch.rsqrt on a CPU
    normed = (x * rstd[:, None]).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (weight[None, :] * normed).to(dtype), mask=mask)


def rms_norm_rows_per_program(hidden: int) -> int:
    """Rows one program normalizes: as many as fit in _TILE_ELEMENTS (one for rows of 4096 and wider)."""
    return max(1, min(_MAX_ROWS_PER_PROGRAM, _TILE_ELEMENTS // triton.next_power_of_2(hidden)))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} {weight.dtype} does not fit rows of {hidden} {x.dtype}")
    rows = x.reshape(-1, hidden)
    assert rows.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, hidden)
    residual_rows = residual_out_rows = rows  # unused pointers without a residual
    residual_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} differs from x {tuple(x.shape)} {x.dtype}")
        residual_rows = residual.reshape(-1, hidden)
        assert residual_rows.stride(-1) == 1
        residual_out = torch.empty_like(out)
        residual_out_rows = residual_out.view(-1, hidden)
    if rows.shape[0] == 0:
        return out, residual_out
    block_n = triton.next_power_of_2(hidden)
    block_rows = rms_norm_rows_per_program(hidden)
    _rms_norm_kernel[(triton.cdiv(rows.shape[0], block_rows),)](
        rows, residual_rows, weight, out_rows, residual_out_rows,
        rows.stride(0), residual_rows.stride(0), out_rows.stride(0), residual_out_rows.stride(0), eps, rows.shape[0],
        N=hidden, BLOCK_N=block_n, BLOCK_ROWS=block_rows, HAS_RESIDUAL=residual is not None,
        **launch_options(num_warps=min(8, max(1, block_rows * block_n // 256)), num_stages=1),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> RMSNorm(x) * weight, a new tensor."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x) * weight, residual + x), both new tensors (the inputs are not written)."""
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out
