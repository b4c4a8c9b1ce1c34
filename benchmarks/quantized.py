"""Quantized weights against the bf16 model of the same shape: the decode step at each batch size next
to each format's read floor, and requests/s on the image workload. Each checkpoint runs in its own
process (latency.py, throughput.py), so each has the device to itself. Each variant also reports how
many projections run each GEMM: an FP8 one runs W8A8 (every step) only where layers/fp8_dispatch.py
lets it, e.g. never for Qwen's 128 x 128 blocks (a compressed-tensors FP8-Dynamic copy, method
"compressed-tensors", has per-channel scales).

    python benchmarks/quantized.py --model LLAVA_7B --variant fp8=LLAVA_7B_FP8 --variant w4a16=LLAVA_7B_GPTQ \
        --device cuda --batch-sizes 1,64 --output quantized.json                   # decode steps
    python benchmarks/quantized.py ... --images --num-requests 512                 # + the image workload

Build the quantized copies of a bf16 checkpoint with mmengine.testing.quantize.quantize_checkpoint
(the GPU suite does: Qwen's 128 x 128 FP8 blocks, GPTQ with groups of 128).
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the 512-request image workload of the GPU suite's image_workload part, without its transformers baseline
IMAGE_WORKLOAD = ["--unique-images", "64", "--image-fraction", "1", "--image-size-max", "640", "--prompt-words", "40",
                  "--prompt-words-min", "40", "--output-len", "128", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
                  "--max-model-len", "4096"]
TINY_IMAGE_WORKLOAD = ["--unique-images", "2", "--image-size-max", "64", "--prompt-words", "6", "--output-len", "3",
                       "--max-num-seqs", "4", "--max-model-len", "256"]


def _run(script: str, args: list[str], scratch: Path, label: str, in_process: bool) -> dict:
    """The sibling script's JSON: in its own process (a GPU's memory is freed between checkpoints), or in
    this one (the tiny CPU runs, where starting Python again would cost more than the run)."""
    output = scratch / f"{label}-{script.removesuffix('.py')}.json"
    argv = [*args, "--output", str(output)]
    print("$ " + " ".join([script, *argv]), flush=True)
    if in_process:
        sys.path.insert(0, str(HERE))
        importlib.import_module(script.removesuffix(".py")).main(argv)
    else:
        subprocess.run([sys.executable, str(HERE / script), *argv], check=True)
    return json.loads(output.read_text())


def measure(label: str, model: str, args: argparse.Namespace, scratch: Path) -> dict:
    latency_args = ["--model", model, "--device", args.device, "--batch-sizes", args.batch_sizes, "--max-model-len",
                    str(args.max_model_len), *args.latency_args]
    latency = _run("latency.py", latency_args, scratch, label, args.tiny)
    row = {"model": model, "decode_weight_bytes": latency["memory"]["decode_weight_bytes"], "paths": latency["quantized_paths"],
           "decode": {r["batch_size"]: {"median_ms": r["median_ms"], "over_floor": r["median_over_floor"]}
                      for r in latency["decode"] if r.get("steps_timed")}}
    if args.images:
        workload = TINY_IMAGE_WORKLOAD if args.tiny else IMAGE_WORKLOAD
        throughput = _run("throughput.py", ["--model", model, "--device", args.device, "--num-requests", str(args.num_requests),
                                            "--skip-baseline", *workload], scratch, label, args.tiny)
        row["requests_per_s"] = throughput["mmengine"]["requests_per_s"]
    return row


def compare(results: dict[str, dict]) -> dict[str, dict]:
    """Each variant's figures over the baseline's: decode step per batch size, requests/s."""
    base = results["bf16"]
    ratios: dict[str, dict] = {}
    for label, row in results.items():
        if label == "bf16":
            continue
        ratios[label] = {"decode_step_over_bf16": {b: row["decode"][b]["median_ms"] / base["decode"][b]["median_ms"]
                                                   for b in row["decode"] if b in base["decode"]},
                         "weight_bytes_over_bf16": row["decode_weight_bytes"] / base["decode_weight_bytes"]}
        if "requests_per_s" in row:
            ratios[label]["requests_per_s_over_bf16"] = row["requests_per_s"] / base["requests_per_s"]
    return ratios


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the bf16 checkpoint")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=PATH", help="a quantized copy (repeatable)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--images", action="store_true", help="also the image workload's requests/s")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--tiny", action="store_true", help="tiny settings (the GPU suite's dry run on the CPU)")
    parser.add_argument("--output", default="benchmarks/results/quantized.json")
    args = parser.parse_args(argv)
    args.latency_args = (["--prompt-tokens", "16", "--warmup-steps", "1", "--decode-steps", "3", "--ttft-repeats", "1",
                          "--image-size", "64x48", "--profile-batch-size", "2", "--profile-steps", "1"] if args.tiny else [])
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    variants = dict(item.split("=", 1) for item in args.variant)
    with tempfile.TemporaryDirectory() as scratch:
        results = {label: measure(label, model, args, Path(scratch)) for label, model in {"bf16": args.model, **variants}.items()}
    report = {"results": results, "ratios": compare(results)}
    for label, ratio in report["ratios"].items():
        steps = ", ".join(f"batch {b}: {r:.2f}x" for b, r in ratio["decode_step_over_bf16"].items())
        paths = ", ".join(f"{k} {v}" for k, v in results[label]["paths"].items() if v)
        print(f"{label}: decode step / bf16 {steps}; weights read {ratio['weight_bytes_over_bf16']:.2f}x"
              + (f"; requests/s {ratio['requests_per_s_over_bf16']:.2f}x" if "requests_per_s_over_bf16" in ratio else "")
              + f"; projections by GEMM: {paths or 'none kept quantized'}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
