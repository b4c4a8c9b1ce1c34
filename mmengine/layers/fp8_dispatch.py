"""Which GEMM an FP8 projection runs: the W8A16 Triton GEMM (kernels/fp8_gemm.py: e4m3 weights
dequantized in registers, activations as they are) or the W8A8 one (kernels/w8a8.py: activations
quantized per token, both operands in FP8 through torch._scaled_mm).

The layer decides once at load whether it may take W8A8 (`why_not_w8a8`), and per call by its row
count. Up to W8A8_MIN_ROWS rows a step is bound by reading the weights, the same e4m3 bytes on either
path: W8A16 loses nothing there and keeps the activations exact, and decode batches up to 64 (every
CUDA-graph bucket of the default max_num_seqs) stay on it. 64 is also the W8A16 GEMM's prefill tile:
beyond it each weight tile is read and decoded in registers once per 64 rows, while _scaled_mm reads
it undecoded and multiplies at twice bf16's tensor-core rate. (On paper an H100's bf16 GEMM over e4m3
weights turns compute-bound at about 150 rows: 990 TFLOPs over 3.35 TB/s, two flops per weight byte
per row; the decoding in registers brings the W8A16 GEMM's turn earlier.) GPU timings to tune it are
pending.
"""

from __future__ import annotations

import torch

W8A8_MIN_ROWS = 64  # a call with more rows than this takes W8A8 where the layer may


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability, or None off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def why_not_w8a8(capability: tuple[int, int] | None, dtype: torch.dtype, in_features: int, out_features: int,
                 group_k: int, activations_dynamic: bool) -> str | None:
    """Why an FP8 projection must stay on the W8A16 GEMM, or None where prefill-shaped calls may take W8A8:
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
