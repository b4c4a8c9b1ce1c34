"""The fuzzer's quick cases on the Triton kernels with cascade on, one per family of fuzz_case.TRITON_FAMILIES (a
file of its own: in Triton's interpreter on a CPU they take minutes, which pytest-xdist runs beside test_fuzz.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from triton.runtime.jit import KernelInterface

from fuzz_case import TRITON_SEEDS, make_case
from fuzzer import FuzzEnv, run_case

# The constexprs that choose a kernel's branch (the others size its tiles)
BRANCHES = ("HAS_SPANS", "ACCUMULATE", "HAS_RESIDUAL", "INTERLEAVED")
# What the seeds launch between them: prefill with and without bidirectional spans (Gemma 4's pictures), split-KV
# decode, cascade's prefix pass and merge, the K/V store, rotary with the store in its three forms (1-D, Qwen2.5-VL's
# sections, Qwen3-VL's interleaved sections), RMSNorm alone and with the residual, SiLU-and-mul, LoRA's shrink and
# accumulating expand, and the fused MoE's two GEMMs
KERNEL_PATHS = {
    "_prefill_kernel HAS_SPANS=False", "_prefill_kernel HAS_SPANS=True", "_decode_split_kernel", "_shared_prefix_kernel",
    "_merge_prefix_kernel", "_store_kv_kernel", "_rotary_kv_kernel INTERLEAVED=False MROPE=False",
    "_rotary_kv_kernel INTERLEAVED=False MROPE=True", "_rotary_kv_kernel INTERLEAVED=True MROPE=True",
    "_rms_norm_kernel HAS_RESIDUAL=False", "_rms_norm_kernel HAS_RESIDUAL=True", "_silu_and_mul_kernel",
    "_segmented_matmul_kernel ACCUMULATE=False", "_segmented_matmul_kernel ACCUMULATE=True", "_gate_up_kernel", "_down_kernel",
}


def _kernel_path(name: str, kwargs: dict[str, Any]) -> str:
    flags = [f"{key}={bool(kwargs[key])}" for key in BRANCHES if key in kwargs]
    if "SECTION_1" in kwargs:  # rotary: multimodal (sectioned) positions or 1-D ones
        flags.append(f"MROPE={bool(kwargs['SECTION_1'])}")
    return " ".join([name, *flags])


@pytest.fixture
def kernel_paths(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The kernel paths launched while the test runs (every `kernel[grid](...)`, interpreted or compiled)."""
    launched: set[str] = set()
    launcher = KernelInterface.__getitem__

    def recording(kernel: KernelInterface, grid: Any) -> Callable[..., Any]:
        run = launcher(kernel, grid)

        def launch(*args: Any, **kwargs: Any) -> Any:
            launched.add(_kernel_path(kernel.fn.__name__, kwargs))
            return run(*args, **kwargs)

        return launch

    monkeypatch.setattr(KernelInterface, "__getitem__", recording)
    return launched


@pytest.fixture(scope="module")
def env(family_checkpoint) -> FuzzEnv:
    return FuzzEnv(family_checkpoint)


def test_seeded_cases_on_the_triton_kernels_with_cascade_on(env, no_tf32, kernel_paths):
    """One quick case per Triton family on the Triton kernels (the interpreter on a CPU) with cascade on; across
    them, cascade really groups requests (three requests on one long system text), and every path of KERNEL_PATHS runs."""
    reports = []
    for seed in TRITON_SEEDS:
        case = make_case(seed, quick=True)
        assert case.options["attn_backend"] == "triton" and case.options["cascade_attention"] == "on"
        reports.append(run_case(case, env))
    assert all(r.requests > 0 and r.steps > 0 for r in reports)
    assert sum(r.cascade_steps > 0 for r in reports) >= 3, [(r.family, r.cascade_steps) for r in reports]
    assert KERNEL_PATHS <= kernel_paths, sorted(KERNEL_PATHS - kernel_paths)
