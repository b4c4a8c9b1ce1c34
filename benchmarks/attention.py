"""Attention kernel speed on a CUDA GPU: mmengine's Triton kernels next to dense SDPA.

For each shape: prefill (varlen over a paged prefix) in time and TFLOP/s; paged split-KV decode in
time and GB/s of K/V read; and torch.nn.functional.scaled_dot_product_attention on the same data
laid out dense (no paging) as a reference point, with the GPU's peak for scale. Writes JSON.

    python benchmarks/attention.py                  # default shape sweep, bfloat16
    python benchmarks/attention.py --dtype float16 --head-dim 128 --num-kv-heads 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
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


def bench(fn, iters: int = 20) -> float:
    """Median milliseconds per call."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=iters * 5, return_mode="median")


def paged_cache(lengths: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
    blocks = [math.ceil(n / block_size) for n in lengths]
    cache = torch.randn(2, sum(blocks), block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    perm = torch.randperm(sum(blocks), device="cuda", dtype=torch.int32)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = perm[start : start + b]
        start += b
    return cache, tables


def prefill_case(batch: int, context: int, new: int, args, dtype) -> dict:
    from mmengine.kernels.prefill_attention import prefill_attention

    lengths = [context + new] * batch
    cache, tables = paged_cache(lengths, args.num_kv_heads, args.head_dim, args.block_size, dtype)
    q = torch.randn(batch * new, args.num_heads, args.head_dim, device="cuda", dtype=dtype)
    qsl = torch.arange(0, batch * new + 1, new, device="cuda", dtype=torch.int32)
    seq = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    scale = args.head_dim**-0.5
    ms = bench(lambda: prefill_attention(q, cache, qsl, seq, tables, scale, new))
    flops = 4 * args.head_dim * args.num_heads * batch * sum(context + p + 1 for p in range(new))
    # dense reference: the same queries over contiguous K/V with the matching causal mask
    qd = q.view(batch, new, args.num_heads, args.head_dim).transpose(1, 2)
    kd = torch.randn(batch, args.num_kv_heads, context + new, args.head_dim, device="cuda", dtype=dtype)
    vd = torch.randn_like(kd)
    mask = torch.arange(context + new, device="cuda")[None, :] <= (context + torch.arange(new, device="cuda"))[:, None]
    sdpa_ms = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True))
    return {"kind": "prefill", "batch": batch, "context": context, "new_tokens": new, "ms": ms,
            "tflops": flops / ms / 1e9, "sdpa_ms": sdpa_ms, "sdpa_tflops": flops / sdpa_ms / 1e9,
            "ratio_to_sdpa": sdpa_ms / ms}


def decode_case(batch: int, context: int, args, dtype) -> dict:
    from mmengine.kernels.decode_attention import decode_attention
    from mmengine.layers.split_kv import choose_num_splits

    lengths = [context] * batch
    cache, tables = paged_cache(lengths, args.num_kv_heads, args.head_dim, args.block_size, dtype)
    q = torch.randn(batch, args.num_heads, args.head_dim, device="cuda", dtype=dtype)
    seq = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    splits = choose_num_splits(batch, args.num_kv_heads, context, torch.cuda.get_device_properties(0).multi_processor_count)
    scale = args.head_dim**-0.5
    ms = bench(lambda: decode_attention(q, cache, seq, tables, scale, splits))
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elem
    qd = q[:, :, None, :]
    kd = torch.randn(batch, args.num_kv_heads, context, args.head_dim, device="cuda", dtype=dtype)
    vd = torch.randn_like(kd)
    sdpa_ms = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
    return {"kind": "decode", "batch": batch, "context": context, "num_splits": splits, "ms": ms,
            "gb_per_s": kv_bytes / ms / 1e6, "sdpa_ms": sdpa_ms, "sdpa_gb_per_s": kv_bytes / sdpa_ms / 1e6,
            "ratio_to_sdpa": sdpa_ms / ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--output", default="benchmarks/results/attention.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/attention.py measures GPU kernels and needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    peak = peak_for(name)
    rows = []
    for batch, context, new in [(1, 0, 4096), (4, 0, 2048), (8, 2048, 512), (32, 1024, 128)]:
        rows.append(prefill_case(batch, context, new, args, dtype))
    for batch, context in [(1, 32768), (8, 8192), (32, 4096), (128, 2048), (256, 1024)]:
        rows.append(decode_case(batch, context, args, dtype))
    print(f"{name}  {args.dtype}  heads {args.num_heads}/{args.num_kv_heads}  head_dim {args.head_dim}  block {args.block_size}")
    if peak:
        print(f"peak: {peak[0]:.0f} TFLOP/s, {peak[1]:.0f} GB/s")
    for r in rows:
        if r["kind"] == "prefill":
            print(f"prefill b={r['batch']:<3} ctx={r['context']:<5} new={r['new_tokens']:<5} {r['ms']:8.3f} ms "
                  f"{r['tflops']:7.1f} TFLOP/s | SDPA {r['sdpa_tflops']:7.1f} TFLOP/s | {r['ratio_to_sdpa']:.0%} of SDPA")
        else:
            frac = f" | {r['gb_per_s'] / peak[1]:.0%} of peak" if peak else ""
            print(f"decode  b={r['batch']:<3} ctx={r['context']:<5} splits={r['num_splits']:<3} {r['ms']:8.3f} ms "
                  f"{r['gb_per_s']:7.0f} GB/s | SDPA {r['sdpa_gb_per_s']:7.0f} GB/s{frac}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"gpu": name, "peak": peak, "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
