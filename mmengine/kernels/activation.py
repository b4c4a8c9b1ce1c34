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


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=mask)


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
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out_rows, rows.stride(0), out_rows.stride(0), inter, BLOCK=block,
        **launch_options(num_warps=min(4, max(1, block // 256)), num_stages=1),
    )
    return out
