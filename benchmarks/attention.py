"""Attention kernel speed on a CUDA GPU: mmengine's Triton kernels next to flash SDPA.

For each shape: prefill (varlen, with or without a paged prefix) in time and TFLOP/s; paged split-KV
decode in time and GB/s of K/V read; and torch.nn.functional.scaled_dot_product_attention on the same
data laid out dense as the anchor, with the GPU's peak for scale. The prefill anchor is SDPA pinned to
the flash backend with `is_causal=True` (no prefix), or the bottom-right causal mask a paged prefix
needs (flash or memory-efficient); each row says which backend ran. Writes JSON.

    python benchmarks/attention.py                  # default shape sweep, bfloat16, GQA 4
    python benchmarks/attention.py --num-heads 28 --num-kv-heads 4   # Qwen2.5-VL-7B's GQA 7
    python benchmarks/attention.py --cpu-check      # tiny shapes in Triton's interpreter: checks the script
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# Dense bf16/fp16 tensor-core peak (TFLOP/s) and memory bandwidth (GB/s), from the vendors' sheets.
PEAKS = {"H100": (989.0, 3350.0), "H200": (989.0, 4800.0), "A100": (312.0, 2039.0), "L40S": (362.0, 864.0)}


def peak_for(name: str) -> tuple[float, float] | None:
    for key, peak in PEAKS.items():
        if key in name:
            return peak
    return None


# (batch, prefix tokens, new tokens): 512 to 16k new tokens, without and with a paged prefix
PREFILL_SHAPES = [(1, 0, 512), (1, 0, 2048), (1, 0, 4096), (1, 0, 8192), (1, 0, 16384), (4, 0, 2048),
                  (1, 2048, 2048), (1, 8192, 2048), (8, 2048, 512), (32, 1024, 128)]
DECODE_SHAPES = [(1, 32768), (8, 8192), (32, 4096), (128, 2048), (256, 1024)]
# --cpu-check: tiny shapes the interpreter runs in seconds
CPU_PREFILL_SHAPES, CPU_DECODE_SHAPES = [(1, 0, 32), (2, 16, 16)], [(2, 48)]


def bench(fn: Callable[[], object], device: str, iters: int = 20) -> float:
    """Median milliseconds per call (on CPU, of one call: the interpreter checks, it does not time)."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=iters * 5, return_mode="median")


def sdpa_anchor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int) -> tuple[Callable[[], object], str]:
    """Dense SDPA over the same queries and keys, and the backend it runs on: flash with `is_causal`
    when there is no prefix; with one, the bottom-right causal mask on flash or memory-efficient
    attention. If the pinned backends refuse the shape, PyTorch's own choice (said in the row)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if context == 0:
        backends, name = [SDPBackend.FLASH_ATTENTION], "flash, is_causal"
        call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        backends, name = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION], "flash/efficient, bottom-right causal"
        mask = causal_lower_right(q.shape[2], k.shape[2])
        call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    if q.device.type != "cuda":
        return call, "math (CPU check)"

    def pinned() -> object:
        with sdpa_kernel(backends):
            return call()

    try:
        pinned()
    except RuntimeError:
        return call, "default (the pinned backends refused this shape)"
    return pinned, name


def paged_cache(lengths: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: str):
    blocks = [math.ceil(n / block_size) for n in lengths]
    cache = torch.randn(2, sum(blocks), block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    perm = torch.randperm(sum(blocks), device=device, dtype=torch.int32)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = perm[start : start + b]
        start += b
    return cache, tables


def prefill_case(batch: int, context: int, new: int, args, dtype, device: str) -> dict:
    from mmengine.kernels.prefill_attention import prefill_attention

    lengths = [context + new] * batch
    cache, tables = paged_cache(lengths, args.num_kv_heads, args.head_dim, args.block_size, dtype, device)
    q = torch.randn(batch * new, args.num_heads, args.head_dim, device=device, dtype=dtype)
    qsl = torch.arange(0, batch * new + 1, new, device=device, dtype=torch.int32)
    seq = torch.tensor(lengths, device=device, dtype=torch.int32)
    scale = args.head_dim**-0.5
    ms = bench(lambda: prefill_attention(q, cache, qsl, seq, tables, scale, new), device)
    flops = 4 * args.head_dim * args.num_heads * batch * sum(context + p + 1 for p in range(new))
    # the anchor: the same queries over contiguous K/V
    qd = q.view(batch, new, args.num_heads, args.head_dim).transpose(1, 2)
    kd = torch.randn(batch, args.num_kv_heads, context + new, args.head_dim, device=device, dtype=dtype)
    vd = torch.randn_like(kd)
    anchor, backend = sdpa_anchor(qd, kd, vd, context)
    sdpa_ms = bench(anchor, device)
    return {"kind": "prefill", "batch": batch, "context": context, "new_tokens": new, "ms": ms,
            "tflops": flops / ms / 1e9, "sdpa_ms": sdpa_ms, "sdpa_tflops": flops / sdpa_ms / 1e9,
            "ratio_to_sdpa": sdpa_ms / ms, "sdpa_backend": backend}


def decode_case(batch: int, context: int, args, dtype, device: str) -> dict:
    from mmengine.kernels.decode_attention import decode_attention
    from mmengine.layers.split_kv import choose_num_splits

    lengths = [context] * batch
    cache, tables = paged_cache(lengths, args.num_kv_heads, args.head_dim, args.block_size, dtype, device)
    q = torch.randn(batch, args.num_heads, args.head_dim, device=device, dtype=dtype)
    seq = torch.tensor(lengths, device=device, dtype=torch.int32)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 8
    splits = choose_num_splits(batch, args.num_kv_heads, context, sm_count)
    scale = args.head_dim**-0.5
    ms = bench(lambda: decode_attention(q, cache, seq, tables, scale, splits), device)
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elem
    qd = q[:, :, None, :]
    kd = torch.randn(batch, args.num_kv_heads, context, args.head_dim, device=device, dtype=dtype)
    vd = torch.randn_like(kd)
    sdpa_ms = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), device)
    return {"kind": "decode", "batch": batch, "context": context, "num_splits": splits, "ms": ms,
            "gb_per_s": kv_bytes / ms / 1e6, "sdpa_ms": sdpa_ms, "sdpa_gb_per_s": kv_bytes / sdpa_ms / 1e6,
            "ratio_to_sdpa": sdpa_ms / ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cpu-check", action="store_true",
                        help="tiny shapes, fp32, Triton's interpreter on the CPU: checks the script, measures nothing")
    parser.add_argument("--output", default="benchmarks/results/attention.json")
    args = parser.parse_args(argv)
    if args.cpu_check:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (they are, lazily, below)
        if args.num_heads % args.num_kv_heads:
            raise SystemExit(f"--num-heads {args.num_heads} is not a multiple of --num-kv-heads {args.num_kv_heads}")
        # the same query heads per KV head (the GQA group the kernels tile by), on one KV head
        args.num_heads, args.num_kv_heads, args.head_dim, args.dtype = args.num_heads // args.num_kv_heads, 1, 32, "float32"
        device, dtype, name, prefill_shapes, decode_shapes = "cpu", torch.float32, "CPU (check)", CPU_PREFILL_SHAPES, CPU_DECODE_SHAPES
    elif not torch.cuda.is_available():
        print("benchmarks/attention.py measures GPU kernels and needs a CUDA GPU (--cpu-check runs it tiny)", file=sys.stderr)
        return 2
    else:
        device, dtype, name = "cuda", getattr(torch, args.dtype), torch.cuda.get_device_name()
        prefill_shapes, decode_shapes = PREFILL_SHAPES, DECODE_SHAPES
    peak = peak_for(name)
    rows = [prefill_case(batch, context, new, args, dtype, device) for batch, context, new in prefill_shapes]
    rows += [decode_case(batch, context, args, dtype, device) for batch, context in decode_shapes]
    print(f"{name}  {args.dtype}  heads {args.num_heads}/{args.num_kv_heads}  head_dim {args.head_dim}  block {args.block_size}")
    if peak:
        print(f"peak: {peak[0]:.0f} TFLOP/s, {peak[1]:.0f} GB/s")
    for r in rows:
        if r["kind"] == "prefill":
            print(f"prefill b={r['batch']:<3} ctx={r['context']:<5} new={r['new_tokens']:<5} {r['ms']:8.3f} ms "
                  f"{r['tflops']:7.1f} TFLOP/s | SDPA {r['sdpa_tflops']:7.1f} TFLOP/s | {r['ratio_to_sdpa']:.0%} of SDPA ({r['sdpa_backend']})")
        else:
            frac = f" | {r['gb_per_s'] / peak[1]:.0%} of peak" if peak else ""
            print(f"decode  b={r['batch']:<3} ctx={r['context']:<5} splits={r['num_splits']:<3} {r['ms']:8.3f} ms "
                  f"{r['gb_per_s']:7.0f} GB/s | SDPA {r['sdpa_gb_per_s']:7.0f} GB/s{frac}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"gpu": name, "device": device, "peak": peak, "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
