"""SiLU-and-mul over the fused gate/up projection: out = silu(gate) * up in one pass.

Numerics follow transformers in the model dtype: silu computed in float32 and rounded to the
model dtype, then the product rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmengine.kernels.common import launch_options

_BLOCK_MAX = 1024
# Rows one program takes where a row's columns fill less than _BLOCK_MAX (one row for intermediates of 1024 and up).
_MAX_ROWS_PER_PROGRAM = 64


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter_size, num_rows, BLOCK: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < inter_size)[None, :]
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + inter_size, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (act * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] (gate, then up) -> silu(gate) * up [..., I], a new tensor."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even (gate then up), got {width}")
    inter = width // 2
    rows = gate_up.reshape(-1, width)
    assert rows.stride(-1) == 1
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0 or inter == 0:
        return out
    out_rows = out.view(-1, inter)
    block = min(_BLOCK_MAX, triton.next_power_of_2(inter))
    block_rows = min(_MAX_ROWS_PER_PROGRAM, _BLOCK_MAX // block)
    _silu_and_mul_kernel[(triton.cdiv(rows.shape[0], block_rows), triton.cdiv(inter, block))](
        rows, out_rows, rows.stride(0), out_rows.stride(0), inter, rows.shape[0], BLOCK=block, BLOCK_ROWS=block_rows,
        **launch_options(num_warps=min(4, max(1, block_rows * block // 256)), num_stages=1),
    )
    return out
