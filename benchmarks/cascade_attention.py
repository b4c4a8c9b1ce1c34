"""Decode attention with and without cascade (shared-prefix) attention, kernel level.

A decode batch of `groups` x `members` requests: each group shares a prefix of `shared` tokens
(the same KV blocks), each request has `unique` tokens of its own after it. Without cascade every
request reads its whole context (split-KV paged decode); with cascade each group's decodes read
the prefix once, as rows of one tile, and merge with their own suffix attention. Both run through
the Triton attention backend exactly as an engine step would (the host plan included), and their
outputs are compared. Prints the times, the K/V bytes each way reads and the ratio; writes JSON.

    python benchmarks/cascade_attention.py                   # the RFC shape: 16 x 16, 2000 + 200, bf16
    python benchmarks/cascade_attention.py --members 1,4,16  # where cascade starts to pay
    python benchmarks/cascade_attention.py --tiny            # CPU: tiny shapes in Triton's interpreter

Without a GPU only --tiny runs (a correctness run of the same code; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

TINY = dict(groups=2, members="4", shared=32, unique=9, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
            dtype="float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=16, help="prefix groups in the batch")
    parser.add_argument("--members", default="16", help="requests per group; a comma list runs each")
    parser.add_argument("--shared", type=int, default=2000, help="shared prefix tokens (rounded down to whole blocks)")
    parser.add_argument("--unique", type=int, default=200, help="each request's own tokens after the prefix")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shuffle", action="store_true",
                        help="scatter each group's requests over the batch (as arrivals do) instead of packing them")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (fp32); runs on CPU in Triton's interpreter")
    parser.add_argument("--output", default="benchmarks/results/cascade_attention.json")
    args = parser.parse_args(argv)
    if args.tiny:  # tiny defaults; options given explicitly still apply
        for name, value in TINY.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    try:
        args.members = [int(m) for m in str(args.members).split(",")]
    except ValueError:
        parser.error(f"--members expected a comma-separated list of ints, got {args.members!r}")
    if args.shared < args.block_size or min(args.members) < 1 or args.groups < 1 or args.unique < 1:
        parser.error("expected --shared >= --block-size, and --members, --groups, --unique >= 1")
    if args.num_heads % args.num_kv_heads:
        parser.error("expected --num-heads to be a multiple of --num-kv-heads")
    return args


def bench_ms(fn) -> float:
    """Median milliseconds per call on the GPU."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median")


def timed_once(fn):
    """fn()'s result and its milliseconds: on CPU, where the interpreter checks and times nothing, the one call
    whose output is compared is the time reported."""
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


def graph_ms(fn, calls: int = 20) -> float:
    """Median device milliseconds per call, with `calls` calls captured in one CUDA graph: the
    engine's decode steps replay graphs, so this leaves out the launch cost that eager timing
    (bench_ms) includes, and that dominates at small batches."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=100, return_mode="median") / calls


def decode_batch(args: argparse.Namespace, members: int, device: torch.device, dtype: torch.dtype):
    """The paged cache, the queries and the host-side tables of one decode step."""
    bs = args.block_size
    shared_blocks = args.shared // bs
    seq_len = shared_blocks * bs + args.unique
    own_blocks = math.ceil(seq_len / bs) - shared_blocks
    num_reqs = args.groups * members
    total = args.groups * shared_blocks + num_reqs * own_blocks
    cache = torch.randn(2, total, bs, args.num_kv_heads, args.head_dim, device=device, dtype=dtype)
    ids = torch.randperm(total).tolist()
    tables = []
    for _ in range(args.groups):
        prefix = [ids.pop() for _ in range(shared_blocks)]
        tables += [prefix + [ids.pop() for _ in range(own_blocks)] for _ in range(members)]
    if args.shuffle:
        tables = [tables[i] for i in torch.randperm(len(tables)).tolist()]
    query = torch.randn(num_reqs, args.num_heads, args.head_dim, device=device, dtype=dtype)
    return cache, query, tables, [seq_len] * num_reqs


def run_case(args: argparse.Namespace, members: int, device: torch.device, dtype: torch.dtype) -> dict:
    import numpy as np

    from mmengine.layers.attention import AttentionMetadata
    from mmengine.layers.cascade import CascadeMetadata, count_tiles, layout_cascade, tokens_per_tile
    from mmengine.layers.triton_attention import TritonAttentionBackend
    from mmengine.runner.cascade_plan import CascadePolicy

    cache, query, tables, seq_lens = decode_batch(args, members, device, dtype)
    num_reqs = len(tables)
    query_lens = [1] * num_reqs
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes_per_token = 2 * args.num_kv_heads * args.head_dim * elem
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, [-1] * num_reqs, device)

    # the host plan as the runner makes it ("on": group whatever shares; "auto" is reported)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    policy = CascadePolicy("on", args.block_size, tokens_per_tile(args.num_heads, args.num_kv_heads), kv_bytes_per_token,
                           num_kv_heads=args.num_kv_heads, num_sms=num_sms)
    start = time.perf_counter()
    groups = policy.plan(tables, query_lens, seq_lens)
    num_tiles = count_tiles(groups, query_lens, policy.tokens_per_tile)
    splits = policy.prefix_splits(num_tiles, max((g.num_prefix_blocks for g in groups), default=1) * args.block_size)
    layout = layout_cascade(groups, np.array(query_lens), np.array(seq_lens), np.array(tables), args.block_size,
                            policy.tokens_per_tile, splits)
    plan_ms = (time.perf_counter() - start) * 1e3
    auto_engages = bool(replace(policy, mode="auto").plan(tables, query_lens, seq_lens))
    cascade_md = replace(metadata, cascade=CascadeMetadata.from_layout(layout, device))

    backend = TritonAttentionBackend()
    scale = args.head_dim**-0.5
    plain_out, plain_ms = timed_once(lambda: backend.forward(query, cache, metadata, scale))
    cascade_out, cascade_ms = timed_once(lambda: backend.forward(query, cache, cascade_md, scale))
    max_abs_diff = (plain_out.float() - cascade_out.float()).abs().max().item()
    on_cuda = device.type == "cuda"
    graphed = {}
    if on_cuda:
        plain_ms = bench_ms(lambda: backend.forward(query, cache, metadata, scale))
        cascade_ms = bench_ms(lambda: backend.forward(query, cache, cascade_md, scale))
        plain_graph = graph_ms(lambda: backend.forward(query, cache, metadata, scale))
        cascade_graph = graph_ms(lambda: backend.forward(query, cache, cascade_md, scale))
        graphed = {"plain_graph_ms": plain_graph, "cascade_graph_ms": cascade_graph, "graph_speedup": plain_graph / cascade_graph}

    shared = args.shared // args.block_size * args.block_size
    plain_bytes = sum(seq_lens) * kv_bytes_per_token
    cascade_bytes = (args.groups * shared + num_reqs * (seq_lens[0] - shared)) * kv_bytes_per_token
    return {
        "groups": args.groups, "members": members, "batch": num_reqs, "shared_tokens": shared,
        "unique_tokens": args.unique, "num_cascade_groups": len(groups), "auto_engages": auto_engages,
        "plain_ms": plain_ms, "cascade_ms": cascade_ms, "speedup": plain_ms / cascade_ms,
        "plain_kv_bytes": plain_bytes, "cascade_kv_bytes": cascade_bytes,
        "plain_gb_per_s": plain_bytes / plain_ms / 1e6, "cascade_effective_gb_per_s": plain_bytes / cascade_ms / 1e6,
        "host_plan_ms": plan_ms, "max_abs_diff": max_abs_diff, **graphed,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        if not args.tiny:
            print("benchmarks/cascade_attention.py times GPU kernels and needs a CUDA GPU; "
                  "--tiny runs the same code at tiny shapes on CPU in Triton's interpreter", file=sys.stderr)
            raise SystemExit(2)
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    if not on_cuda and args.dtype == "bfloat16":
        raise SystemExit("bfloat16 needs a GPU (Triton's interpreter mishandles it)")
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if on_cuda else f"cpu ({platform.processor() or platform.machine()}), interpreter"
    rows = [run_case(args, members, device, dtype) for members in args.members]
    print(f"{name}  {args.dtype}  rows {'shuffled' if args.shuffle else 'packed by group'}  heads {args.num_heads}/{args.num_kv_heads}  head_dim {args.head_dim}  "
          f"block {args.block_size}  shared {rows[0]['shared_tokens']} + unique {args.unique}")
    for r in rows:
        print(f"{r['groups']} groups x {r['members']:<3} (batch {r['batch']:<4}) no cascade {r['plain_ms']:8.3f} ms "
              f"({r['plain_gb_per_s']:6.0f} GB/s) | cascade {r['cascade_ms']:8.3f} ms | {r['speedup']:5.2f}x "
              f"| K/V read {r['plain_kv_bytes'] / r['cascade_kv_bytes']:5.2f}x less | auto: {'on' if r['auto_engages'] else 'off'} "
              f"| plan {r['host_plan_ms']:.2f} ms | max diff {r['max_abs_diff']:.2e}")
        if "graph_speedup" in r:
            print(f"{'':>30} in CUDA graphs: no cascade {r['plain_graph_ms']:8.3f} ms | cascade {r['cascade_graph_ms']:8.3f} ms | "
                  f"{r['graph_speedup']:5.2f}x")
    if not on_cuda:
        print("(interpreter: a correctness run; the times say nothing about a GPU)")
    result = {"device": name, "dtype": args.dtype, "args": {k: v for k, v in vars(args).items() if k != "output"}, "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
