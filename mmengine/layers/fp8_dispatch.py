"""Which GEMM an FP8 projection runs: the W8A16 Triton GEMM (kernels/fp8_gemm.py: e4m3 weights
dequantized in registers, activations as they are) or the W8A8 one (kernels/w8a8.py: activations
quantized per token, both operands in FP8 through torch._scaled_mm).

The layer decides once at load (`why_not_w8a8`), and then runs every call on the same path, decode
and prefill alike: a token's numbers never depend on how many rows its step had (a prefix-cache hit
reads K/V computed by the same arithmetic as a recomputation would). Per-token quantization is a
row's own: W8A8 stays batch-invariant. For decode both paths read the same e4m3 weight bytes; for
prefill-shaped steps _scaled_mm multiplies at twice bf16's tensor-core rate. GPU timings are pending.
"""

from __future__ import annotations

import torch

def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability, or None off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def why_not_w8a8(capability: tuple[int, int] | None, dtype: torch.dtype, in_features: int, out_features: int,
                 group_k: int, activations_dynamic: bool) -> str | None:
    """Why an FP8 projection must stay on the W8A16 GEMM, or None where it runs W8A8:
    the checkpoint declares dynamic activation quantization, the device has FP8 tensor cores, the model
    runs in 16 bits, the weight has one scale per output channel and _scaled_mm takes its shape."""
    if not activations_dynamic:
        return "the checkpoint does not declare dynamic activation quantization"
    if capability is None or capability < (8, 9):
        return "torch._scaled_mm's FP8 needs a CUDA GPU of compute capability 8.9+"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"activations in {dtype} (an fp32 model is a correctness run: exact W8A16)"
    if group_k < in_features:
        return "block-scaled weights (torch._scaled_mm's block-wise scaling is not used)"
    if in_features % 16 or out_features % 16:
        return f"a {in_features} x {out_features} projection (torch._scaled_mm needs multiples of 16)"
    return None
