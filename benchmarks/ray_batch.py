"""Data-parallel batches on Ray: throughput and cache work for 1, 2 and 4 replicas, with and without
cache-affine placement.

    python benchmarks/ray_batch.py                                   # tiny model on CPU, local Ray cluster
    python benchmarks/ray_batch.py --build-7b /tmp/llava-1.5-7b --replicas 1,2,4 \\
        --images 64 --per-image 16 --groups 16 --degree 16 --output-len 64   # LLaVA-1.5-7B shape, 1 GPU per replica

The workload: `--images` pictures, each asked `--per-image` different questions, plus `--groups` groups
of `--degree` text prompts that share their first `--shared-len` tokens (then `--unique-len` of their
own), all shuffled. Every prompt generates `--output-len` tokens (greedy, EOS ignored).

For each replica count a BatchRunner starts its actors once (start-up time is reported apart), then
runs the batch with affinity ("prefix+image") and without (round-robin), on fresh engines each time
(best of --repeats).
Reported: requests/s and output tokens/s of the run, encoder runs per unique image (1.0 is the
minimum), and prefill tokens computed against the minimum (each shared prefix and each picture's
prompt once). JSON goes to --output.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import ensure_checkpoint  # noqa: E402  (a sibling script)

import ray  # noqa: E402

from mmengine.ray import BatchRunner  # noqa: E402
from mmengine.testing import LLAVA_1_5_7B_SPEC, make_test_image, tiny_llava_path  # noqa: E402

ONE_TOKEN_WORDS = "the and are at be car dog image in is of on read small there this to was with you".split()


def png(seed: int, size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    make_test_image(seed, size).save(buffer, "PNG")
    return buffer.getvalue()


def workload(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(0)

    def words(n: int) -> str:
        return "".join(" " + rng.choice(ONE_TOKEN_WORDS) for _ in range(n))

    params = {"max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    rows = []
    for image in range(args.images):
        picture = png(image, args.image_size)
        for q in range(args.per_image):
            rows.append({"prompt": f"USER: <image>\nQuestion {q}:{words(4)}? ASSISTANT:", "images": [picture], "sampling_params": params})
    for _ in range(args.groups):
        shared = words(args.shared_len - 1)  # + BOS
        rows += [{"prompt": shared + words(args.unique_len), "images": [], "sampling_params": params} for _ in range(args.degree)]
    rng.shuffle(rows)
    return rows


def run_mode(runner: BatchRunner, ds: object, affinity: str | None, num_rows: int, args: argparse.Namespace) -> dict:
    seconds = float("inf")
    for _ in range(args.repeats):  # the best of a few runs, each on fresh engines
        runner.reset()
        start = time.perf_counter()
        result = runner.run(ds, affinity=affinity)
        seconds = min(seconds, time.perf_counter() - start)
    stats = result.replica_stats
    encoder_runs = sum(s["encoder_runs"] for s in stats)
    return {
        "replicas": runner.num_replicas,
        "affinity": affinity or "round-robin",
        "seconds": round(seconds, 3),
        "requests_per_s": round(num_rows / seconds, 2),
        "output_tokens_per_s": round(sum(s["generation_tokens"] for s in stats) / seconds, 1),
        "encoder_runs": encoder_runs,
        "encoder_runs_per_image": round(encoder_runs / args.images, 2) if args.images else None,
        "prefill_tokens_computed": sum(s["prefill_tokens_computed"] for s in stats),
        "rows_per_replica": result.placement.loads,
        "steps_per_replica": [s["steps"] for s in stats],  # on a tiny model, wall time follows the longest
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: the tiny LLaVA)")
    parser.add_argument("--build-7b", default=None, metavar="DIR", help="build (if missing) and use the LLaVA-1.5-7B shape here; 1 GPU per replica")
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--per-image", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--degree", type=int, default=8)
    parser.add_argument("--shared-len", type=int, default=64)
    parser.add_argument("--unique-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--image-size", type=lambda s: tuple(int(v) for v in s.split("x")), default=(64, 48))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode; the fastest counts")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per call to a replica")
    parser.add_argument("--num-gpus", type=float, default=None, help="per replica (default: 1 with --build-7b, else 0)")
    parser.add_argument("--num-cpus", type=float, default=None, help="per replica on CPU (default: the cores / largest replica count)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="each replica's share of its GPU (replicas sharing one GPU: e.g. 0.45 with --num-gpus 0.5)")
    parser.add_argument("--output", default="benchmarks/results/ray_batch.json")
    args = parser.parse_args(argv)

    if args.build_7b:
        model, _ = ensure_checkpoint(Path(args.build_7b), LLAVA_1_5_7B_SPEC, "cuda", "bfloat16")
        num_gpus = 1 if args.num_gpus is None else args.num_gpus
    else:
        model = Path(args.model) if args.model else tiny_llava_path()
        num_gpus = args.num_gpus or 0
    replica_counts = [int(v) for v in args.replicas.split(",")]
    cores = os.cpu_count() or 1
    num_cpus = args.num_cpus or (1 if num_gpus else max(0.25, cores / max(replica_counts)))
    rows = workload(args)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                 **({} if num_gpus else {"num_cpus": max(cores, num_cpus * max(replica_counts))}))
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.from_items(rows).materialize()
    engine_options = {"max_model_len": args.max_model_len}
    if args.gpu_memory_utilization is not None:
        engine_options["gpu_memory_utilization"] = args.gpu_memory_utilization

    results = []
    for count in replica_counts:
        start = time.perf_counter()
        with BatchRunner(model, count, engine_options, num_gpus=num_gpus, num_cpus=num_cpus, batch_size=args.batch_size) as runner:
            startup = time.perf_counter() - start
            runner.run(ds, affinity=None)  # a warm-up pass: first-call costs (allocator, lazy imports) out of the timing
            for affinity in ("prefix+image", None):
                results.append({**run_mode(runner, ds, affinity, len(rows), args), "startup_s": round(startup, 2)})

    minimum = args.groups * args.shared_len + args.groups * args.degree * args.unique_len
    print(f"{len(rows)} rows: {args.images} images x {args.per_image}, {args.groups} text groups x {args.degree} "
          f"(minimum text prefill {minimum} tokens); {'GPU' if num_gpus else f'CPU, {num_cpus:g} cpus/replica'}")
    header = f"{'replicas':>8} {'placement':>13} {'req/s':>8} {'out tok/s':>10} {'enc runs/img':>12} {'prefill tok':>12} {'rows/replica':>16} {'steps/replica':>18}"
    print(header)
    for r in results:
        print(f"{r['replicas']:>8} {r['affinity']:>13} {r['requests_per_s']:>8} {r['output_tokens_per_s']:>10} "
              f"{r['encoder_runs_per_image']!s:>12} {r['prefill_tokens_computed']:>12} {str(r['rows_per_replica']):>16} {str(r['steps_per_replica']):>18}")
    report = {
        "model": str(model),
        "platform": platform.platform(),
        "cpu_count": cores,
        "num_gpus_per_replica": num_gpus,
        "num_cpus_per_replica": num_cpus,
        "workload": {k: v for k, v in vars(args).items() if k not in ("output", "model", "build_7b")},
        "text_prefill_minimum": minimum,
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
