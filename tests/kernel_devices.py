"""Where the attention kernel tests run their Triton kernels, and how close to the reference they must come:
without a GPU in Triton's interpreter on CPU tensors (fp32, fp16; it mishandles bf16), with one compiled on CUDA
tensors (fp32, fp16, bf16). conftest.py turns the interpreter on only when there is no GPU."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
KERNEL_DEVICE, MODE = ("cuda", "cuda") if CUDA else ("cpu", "interp")
FP32 = pytest.param(KERNEL_DEVICE, torch.float32, id=f"{MODE}-fp32")
FP16 = pytest.param(KERNEL_DEVICE, torch.float16, id=f"{MODE}-fp16")
BF16 = pytest.param(
    "cuda", torch.bfloat16, id="cuda-bf16",
    marks=pytest.mark.skipif(not CUDA, reason="bf16 needs a CUDA GPU (Triton's interpreter mishandles bf16)"),
)
DEVICES = [FP32, FP16, BF16]
# Kernel outputs against an fp32 reference, by the kernel's dtype
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
