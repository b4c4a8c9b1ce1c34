"""Compiles the Triton kernels (attention, the decoder's fused ops, LoRA) for NVIDIA GPUs on a machine without one.

The launchers run on small CPU tensors with Triton's launch intercepted: each launch is recorded
(kernel, arguments, options) instead of executed, then compiled ahead of time to a cubin for a
chosen architecture with Triton's own compiler and ptxas. This checks what the interpreter cannot
(that every kernel compiles for sm_80/sm_90 in fp16 and bf16 with the launchers' real block sizes,
warps and stages) and reports the resources ptxas assigned: registers per thread, shared memory,
and local memory (register spills).

Run `python -m mmengine.kernels.cross_compile [--json FILE]` with TRITON_INTERPRET unset: kernels
decorated in interpreter mode cannot be compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from mmengine.kernels.tiling import tokens_per_tile

# Triton's e4m3 type (the FP8 KV cache) needs compute capability 8.9 (Ada, Hopper and later).
FP8_MIN_ARCH = 89
# Per-SM shared memory a block may use (KiB): the kernels must fit on both generations.
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
_TORCH_TO_TRITON = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
}


@dataclass
class Launch:
    """One recorded kernel launch."""

    kernel: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    min_arch: int = 0  # FP8 (e4m3) pointers need sm_89+: Triton refuses them for sm_80
    max_arch: int = 1000  # e4m3 read as bits (uint8) runs only where Triton has no e4m3 type: below sm_89

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclass
class KernelResources:
    kernel: str
    case: str
    arch: int
    num_warps: int
    num_stages: int
    registers: int
    shared_bytes: int
    local_bytes: int  # > 0 means registers spilled to local memory
    mma: str  # tensor-core instructions of the dots: "wgmma" (Hopper), "mma" (Ampere style) or "none"
    async_copy: bool  # K/V tiles prefetched into shared memory by asynchronous copies (pipelined loop)
    constexprs: dict[str, Any] = field(default_factory=dict)

    def problems(self) -> list[str]:
        found = []
        if self.local_bytes > 0:
            found.append(f"{self.local_bytes} bytes of register spills")
        if self.shared_bytes > SHARED_MEMORY_LIMIT[self.arch]:
            found.append(f"{self.shared_bytes} bytes of shared memory > sm_{self.arch}'s {SHARED_MEMORY_LIMIT[self.arch]}")
        return found


@contextlib.contextmanager
def capture_launches() -> Iterator[list[Launch]]:
    """Within the block, `kernel[grid](...)` records the launch instead of running it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("cross-compiling needs TRITON_INTERPRET unset when the kernels are imported")
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.run = original  # type: ignore[method-assign]


def _specialize(value: Any) -> tuple[str, Any, bool]:
    """(type, constant or None, divisible by 16) following Triton's default launch specialization:
    tensors become typed pointers, the integer 1 and None become constants, other ints i32/i64."""
    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TO_TRITON[value.dtype], None, value.data_ptr() % 16 == 0
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
        return "constexpr", value, False
    if isinstance(value, bool):
        return "u1", None, False
    if isinstance(value, int):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), None, value % 16 == 0
    if isinstance(value, float):
        return "fp32", None, False
    raise TypeError(f"cannot specialize a kernel argument of type {type(value).__name__}")


def specialization(launch: Launch) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], list[list[Any]]]]:
    """The (signature, constexprs, attributes) Triton compiles a launch with: what decides whether
    two launches share a compiled kernel. Arguments in the kernel's do_not_specialize keep their
    plain type."""
    kernel = launch.kernel
    bound = dict(zip(kernel.arg_names, launch.args))
    bound.update({k: v for k, v in launch.kwargs.items() if k not in LAUNCH_OPTIONS})
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        if param.do_not_specialize and isinstance(value, int) and not isinstance(value, bool):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            continue
        signature[param.name], constant, divisible = _specialize(value)
        if signature[param.name] == "constexpr":
            constexprs[param.name] = constant
        elif divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def compile_launch(launch: Launch, arch: int) -> tuple[Any, dict[str, Any]]:
    """Compiles a recorded launch for sm_<arch>; returns (compiled kernel, its constexprs)."""
    options = {k: launch.kwargs[k] for k in LAUNCH_OPTIONS if k in launch.kwargs}
    signature, constexprs, attrs = specialization(launch)
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options), constexprs


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """REG, SHARED and LOCAL of the cubin's one function, as ptxas assigned them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], check=True, capture_output=True, text=True).stdout
    found = {key: int(value) for key, value in re.findall(r"\b(REG|SHARED|LOCAL):(\d+)", text)}
    if set(found) != {"REG", "SHARED", "LOCAL"}:
        raise RuntimeError(f"unexpected cuobjdump output:\n{text}")
    return found


def _mma_kind(ttgir: str) -> str:
    if "warp_group_dot" in ttgir:
        return "wgmma"
    return "mma" if "nvidia_mma" in ttgir else "none"


def resources_of(launch: Launch, arch: int, case: str) -> KernelResources:
    compiled, constexprs = compile_launch(launch, arch)
    usage = cubin_resources(compiled.asm["cubin"])
    ttgir = compiled.asm["ttgir"]
    # Dynamic shared memory (the pipelined tiles) is in the metadata; cuobjdump lists only the static part.
    shared = max(compiled.metadata.shared, usage["SHARED"])
    return KernelResources(
        kernel=launch.name, case=case, arch=arch,
        num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
        registers=usage["REG"], shared_bytes=shared, local_bytes=usage["LOCAL"],
        mma=_mma_kind(ttgir), async_copy="async_copy_global_to_local" in ttgir,
        constexprs={k: v for k, v in constexprs.items() if isinstance(v, (int, str)) or v is None},
    )


@dataclass(frozen=True)
class AttentionCase:
    """Shapes of one model's attention as the engine would launch it (tiny token counts suffice:
    what compiles depends on dtype, head dim, GQA group and block size, not on lengths)."""

    dtype: torch.dtype
    head_dim: int
    group: int
    block_size: int
    num_kv_heads: int = 2
    hidden_size: int = 4096  # for the decoder's fused ops (RMSNorm rows, SiLU-and-mul rows)
    intermediate_size: int = 11008
    attention_only: bool = False  # only the launches whose code depends on the attention shape, on sm_90 only

    @property
    def label(self) -> str:
        return f"{_TORCH_TO_TRITON[self.dtype]} d{self.head_dim} g{self.group} bs{self.block_size}"


def record_attention_launches(case: AttentionCase) -> list[Launch]:
    """Every launch one mixed step makes: KV store, prefill over a paged prefix (also with a sliding
    window and bidirectional span ends, its HAS_SPANS variant), split-KV decode with its reduction,
    the LSE merge, and cascade's shared-prefix pass and its merge. (A window is a plain argument:
    decode with one compiles what decode without one does.)"""
    from mmengine.kernels.cascade_attention import cascade_prefix_attention
    from mmengine.kernels.decode_attention import decode_attention
    from mmengine.kernels.kv_store import store_kv
    from mmengine.kernels.merge_states import merge_attn_states
    from mmengine.kernels.prefill_attention import prefill_attention

    kv_heads, heads, dim = case.num_kv_heads, case.num_kv_heads * case.group, case.head_dim
    cache = torch.empty(2, 8, case.block_size, kv_heads, dim, dtype=case.dtype)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    seq_lens = torch.tensor([40, 33], dtype=torch.int32)
    query = torch.empty(8, heads, dim, dtype=case.dtype)
    with capture_launches() as launches:
        key = torch.empty(8, kv_heads, dim, dtype=case.dtype)
        store_kv(key, key, cache, torch.zeros(8, dtype=torch.long))
        span_ends = torch.tensor([35, 39, 39, 39, 39, 32, 32, 32], dtype=torch.int32)
        prefill_attention(query, cache, torch.tensor([0, 5, 8], dtype=torch.int32), seq_lens, tables, 0.1, max_query_len=5,
                          window=16, span_ends=span_ends)
        prefill_attention(query, cache, torch.tensor([0, 5, 8], dtype=torch.int32), seq_lens, tables, 0.1, max_query_len=5)
        out, lse = decode_attention(query[:2], cache, seq_lens, tables, 0.1, num_splits=4)
        merge_attn_states(out, lse, out, lse)
        cascade = _cascade_metadata(case.block_size, heads, kv_heads)
        cascade_prefix_attention(query, cache, cascade, tables, 0.1, query, torch.empty(8, heads))
    return launches


def fp8_arch_range(launches: list[Launch], dtype: torch.dtype) -> list[Launch]:
    """Launches over e4m3 compile for sm_89+ only; over its bits (uint8) only below, where they run."""
    for launch in launches:
        if dtype == torch.float8_e4m3fn:
            launch.min_arch = FP8_MIN_ARCH
        else:
            launch.max_arch = FP8_MIN_ARCH - 1
    return launches


def record_fp8_kv_launches(case: AttentionCase) -> list[Launch]:
    """kv_cache_dtype="fp8": the stores that quantize into an e4m3 cache (plain and fused with rotary),
    and prefill and split-KV decode reading it: on e4m3 (sm_89+) and on its bits (any GPU)."""
    from mmengine.kernels.decode_attention import decode_attention
    from mmengine.kernels.kv_store import store_kv
    from mmengine.kernels.prefill_attention import prefill_attention
    from mmengine.kernels.rotary import rotary_store_kv

    kv_heads, heads, dim = case.num_kv_heads, case.num_kv_heads * case.group, case.head_dim
    tables = torch.zeros(2, 4, dtype=torch.int32)
    seq_lens = torch.tensor([40, 33], dtype=torch.int32)
    query = torch.empty(8, heads, dim, dtype=case.dtype)
    key = torch.empty(8, kv_heads, dim, dtype=case.dtype)
    slots = torch.zeros(8, dtype=torch.long)
    launches = []
    for cache_dtype in (torch.float8_e4m3fn, torch.uint8):
        cache = torch.empty(2, 8, case.block_size, kv_heads, dim, dtype=cache_dtype)
        with capture_launches() as recorded:
            store_kv(key, key, cache, slots, 0.5, 0.25)
            rotary_store_kv(query, key, key, slots, torch.empty(16, 2 * dim, dtype=case.dtype), cache, slots, k_scale=0.5, v_scale=0.25)
            prefill_attention(query, cache, torch.tensor([0, 5, 8], dtype=torch.int32), seq_lens, tables, 0.1, max_query_len=5)
            decode_attention(query[:2], cache, seq_lens, tables, 0.1, num_splits=4)
        launches += fp8_arch_range(recorded, cache_dtype)
    return launches


def _cascade_metadata(block_size: int, num_heads: int, num_kv_heads: int) -> SimpleNamespace:
    """The prefix pass's arguments for one group of two requests (the first 1 and 7 tokens of the step,
    at positions 39 and 26..32) over a one-block prefix, in two splits; only shapes, dtypes and bounds
    matter to a recorded launch."""
    tile, tokens, splits = tokens_per_tile(num_heads, num_kv_heads), 8, 2
    num_tiles = -(-tokens // tile)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return SimpleNamespace(
        token_indices=ints(list(range(tokens))), token_positions=ints([39, *range(26, 33)]), group_starts=ints([0, tokens]),
        prefix_lens=ints([block_size]), group_leaders=ints([0]), tile_groups=ints([0] * num_tiles),
        tile_starts=ints([i * tile for i in range(num_tiles)]), counts=ints([num_tiles * splits, splits, tokens]),
        tile_tokens=tile, max_work=num_tiles * splits, max_tokens=tokens, max_splits=splits,
    )


def record_decoder_launches(case: AttentionCase) -> list[Launch]:
    """Every fused launch of one decoder layer: rotary + K/V store, RMSNorm alone and with the
    residual add, SiLU-and-mul."""
    from mmengine.kernels.activation import silu_and_mul
    from mmengine.kernels.rms_norm import fused_add_rms_norm, rms_norm
    from mmengine.kernels.rotary import rotary_store_kv

    kv_heads, heads, dim = case.num_kv_heads, case.num_kv_heads * case.group, case.head_dim
    cache = torch.empty(2, 8, case.block_size, kv_heads, dim, dtype=case.dtype)
    qkv = torch.empty(4, (heads + 2 * kv_heads) * dim, dtype=case.dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    positions = torch.zeros(4, dtype=torch.long)
    hidden = torch.empty(4, case.hidden_size, dtype=case.dtype)
    weight = torch.empty(case.hidden_size, dtype=case.dtype)
    with capture_launches() as launches:
        rotary_store_kv(
            q.view(4, heads, dim), k.view(4, kv_heads, dim), v.view(4, kv_heads, dim), positions,
            torch.empty(16, 2 * dim, dtype=case.dtype), cache, positions,
        )
        rms_norm(hidden, weight, 1e-6)
        fused_add_rms_norm(hidden, hidden, weight, 1e-6)
        silu_and_mul(torch.empty(4, 2 * case.intermediate_size, dtype=case.dtype))
    return launches


def record_lora_launches(case: AttentionCase, max_rank: int = 16) -> list[Launch]:
    """A LoRA delta on the fused QKV projection: the shrink (hidden -> 3 x rank) and the expand with
    accumulation (3 x rank -> q + k + v), for a decode row and a prefill chunk."""
    from mmengine.kernels.lora import segmented_matmul

    heads = case.num_kv_heads * case.group
    out = (heads + 2 * case.num_kv_heads) * case.head_dim
    width = 3 * max_rank
    x = torch.empty(24, case.hidden_size, dtype=case.dtype)
    a = torch.empty(2, width, case.hidden_size, dtype=case.dtype)
    b = torch.empty(2, out, width, dtype=case.dtype)
    shrunk = torch.empty(24, width, dtype=case.dtype)
    y = torch.empty(24, out, dtype=case.dtype)
    segments = [torch.tensor(v, dtype=torch.int32) for v in ([0, 1], [1, 23], [0, 1])]
    with capture_launches() as launches:
        for max_len in (1, 23):
            segmented_matmul(x, a, shrunk, *segments, max_len, accumulate=False)
            segmented_matmul(shrunk, b, y, *segments, max_len, accumulate=True)
    return launches


def record_moe_launches(case: AttentionCase, num_experts: int = 4, moe_intermediate: int = 512) -> list[Launch]:
    """The fused MoE MLP's two grouped GEMMs (gate/up with SiLU, down with the routing weights) for a
    decode-sized and a prefill-sized batch, top-2 over `num_experts` experts of Qwen3.5-MoE's width."""
    from mmengine.kernels.fused_moe import fused_moe

    gate_up = torch.empty(num_experts, 2 * moe_intermediate, case.hidden_size, dtype=case.dtype)
    down = torch.empty(num_experts, case.hidden_size, moe_intermediate, dtype=case.dtype)
    with capture_launches() as launches:
        for tokens in (1, 24):
            ids = torch.arange(2 * tokens).remainder(num_experts).view(tokens, 2)
            fused_moe(torch.empty(tokens, case.hidden_size, dtype=case.dtype), gate_up, down,
                      torch.full((tokens, 2), 0.5, dtype=case.dtype), ids)
    return launches


def record_w4a16_launches(case: AttentionCase, group_size: int = 128) -> list[Launch]:
    """The W4A16 GEMM on the MLP's down projection (intermediate -> hidden) for a decode-sized and a
    prefill-sized batch."""
    from mmengine.kernels.w4a16 import w4a16_matmul

    k, n = case.intermediate_size, case.hidden_size
    qweight = torch.empty(k // 8, n, dtype=torch.int32)
    scales = torch.empty(k // group_size, n, dtype=case.dtype)
    with capture_launches() as launches:
        for rows in (1, 64):
            w4a16_matmul(torch.empty(rows, k, dtype=case.dtype), qweight, scales, scales, group_size)
    return launches


def record_fp8_gemm_launches(case: AttentionCase) -> list[Launch]:
    """The FP8-weight GEMM on the MLP's down projection in Qwen's 128 x 128 blocks, decode- and
    prefill-sized: on e4m3 (sm_89+) and on its bits (any GPU)."""
    from mmengine.kernels.fp8_gemm import fp8_matmul

    k, n = case.intermediate_size, case.hidden_size
    scales = torch.empty(n, -(-k // 128), dtype=torch.float32)
    launches = []
    for weight_dtype in (torch.float8_e4m3fn, torch.uint8):
        weight = torch.empty(n, k, dtype=weight_dtype)
        with capture_launches() as recorded:
            for rows in (1, 64):
                fp8_matmul(torch.empty(rows, k, dtype=case.dtype), weight, scales, 128)
        launches += fp8_arch_range(recorded, weight_dtype)
    return launches


def default_cases() -> list[AttentionCase]:
    """The issue's head dims and block sizes in both 16-bit types, GQA groups 1 to 8 (7 is padded),
    and the fp32 path (exact dot products) the engine takes for float32 checkpoints."""
    return [
        AttentionCase(dtype, head_dim, group, block_size)
        for dtype in (torch.float16, torch.bfloat16)
        for head_dim in (64, 80, 96, 128)
        for group, block_size in ((1, 16), (4, 32), (7, 16), (8, 16))
    ] + [
        AttentionCase(torch.float32, 128, 4, 16),
        # The widest decoder rows (Llama-2-70B: hidden 8192, 64 query heads over 8 KV heads).
        AttentionCase(torch.bfloat16, 128, 8, 16, num_kv_heads=8, hidden_size=8192, intermediate_size=28672),
    ]


def report(cases: list[AttentionCase], archs: list[int], log: Callable[[str], None] = print) -> list[KernelResources]:
    results = []
    for case in cases:
        launches = record_attention_launches(case) + record_fp8_kv_launches(case) + record_decoder_launches(case)
        if not case.attention_only:
            launches += (record_lora_launches(case) + record_moe_launches(case) + record_w4a16_launches(case)
                         + record_fp8_gemm_launches(case))
        else:
            for launch in launches:
                launch.min_arch = max(launch.min_arch, 90)
        for launch in launches:
            for arch in (a for a in archs if launch.min_arch <= a <= launch.max_arch):
                res = resources_of(launch, arch, case.label)
                results.append(res)
                note = "; ".join(res.problems()) or "ok"
                log(f"sm_{arch} {res.kernel:<24} {case.label:<22} warps {res.num_warps} stages {res.num_stages} "
                    f"regs {res.registers:>3} smem {res.shared_bytes:>6} spill {res.local_bytes:>4} {res.mma:>5}"
                    f"{' async' if res.async_copy else '      '}  {note}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", choices=sorted(SHARED_MEMORY_LIMIT),
                        help="target compute capability (repeatable; default: 80 and 90)")
    parser.add_argument("--quick", action="store_true", help="a few representative cases instead of the full matrix")
    parser.add_argument("--json", help="write the per-kernel resources here")
    args = parser.parse_args(argv)
    archs = args.arch or [80, 90]
    cases = default_cases()
    if args.quick:
        # every kernel in bf16; the attention ones again in fp16 (sm_90) at another head dim, group and block size
        cases = [AttentionCase(torch.bfloat16, 128, 8, 16), AttentionCase(torch.float16, 80, 1, 32, attention_only=True)]
    results = report(cases, archs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    bad = [r for r in results if r.problems()]
    print(f"{len(results)} compiled, {len(bad)} with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
