"""Tensor parallelism's decode step and TTFT, side by side with one device: latency.py on the same checkpoint at
tensor_parallel_size 1 and N. Per batch size: the step at TP N against TP 1's and against one rank's weight-read
floor (every rank reads its share of the weights each step, at once; the aim is <= 1.25x that floor), and the
TTFT of a new picture at both sizes.

On CUDA, TP N needs N GPUs: with fewer it says so, writes a JSON saying it skipped, and runs nothing. Both sizes run
as a user runs them: decode steps replay CUDA graphs, at TP N on every rank (docs/parallelism.md).

    python benchmarks/tensor_parallel.py --model path/to/Qwen2.5-VL-7B-Instruct --device cuda --batch-sizes 1,64
"""

from __future__ import annotations

import gc
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import latency  # noqa: E402  (a sibling script)
from latency import write_json  # noqa: E402


def _latency(argv: list[str], size: int, output: Path) -> dict:
    return latency.main([*argv, "--tensor-parallel-size", str(size), "--output", str(output)])


def _rows(result: dict) -> dict[int, dict]:
    return {row["batch_size"]: row for row in result["decode"] if row.get("steps_timed")}


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv less each of `flags` and its value (as `--flag value` or `--flag=value`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in flags)):
            kept.append(arg)
    return kept


def main(argv: Sequence[str] | None = None) -> dict:
    """latency.py's flags; --tensor-parallel-size N (>= 2, default 2) is the size compared with 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg.split("=")[0] == "--tensor-parallel-size" for arg in argv):
        argv += ["--tensor-parallel-size", "2"]
    args = latency.parse_args(argv)
    size = args.tensor_parallel_size
    if size < 2:
        raise SystemExit(f"--tensor-parallel-size must be at least 2 (it is compared with 1), got {size}")
    passed = _without(argv, ("--tensor-parallel-size", "--output"))
    on_cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    if on_cuda and torch.cuda.device_count() < size:
        reason = f"tensor_parallel_size={size} needs {size} GPUs; this machine has {torch.cuda.device_count()}"
        print(f"skipped: {reason}")
        result = {"skipped": reason, "gpus": torch.cuda.device_count(), "tensor_parallel_size": size}
        write_json(args.output, result)
        return result
    with tempfile.TemporaryDirectory() as scratch:
        one = _latency(passed, 1, Path(scratch) / "tp1.json")
        gc.collect()  # TP 1's engine is gone: its cached device memory goes back before the ranks size their caches
        if on_cuda:
            torch.cuda.empty_cache()
        split = _latency(passed, size, Path(scratch) / f"tp{size}.json")
    result = {"tensor_parallel_size": size, "model": one["model"], "device": one["device"], "dtype": one["dtype"],
              "weight_bytes": one["memory"]["decode_weight_bytes"], "weight_bytes_per_rank": split["memory"]["weight_bytes_per_rank"],
              "decode": [], "tp1_ttft_new_image_ms": one["ttft"]["new_image"]["median_ms"],
              "ttft_new_image_ms": split["ttft"]["new_image"]["median_ms"]}
    print(f"\n{'batch':>6} {'TP 1 ms':>9} {f'TP {size} ms':>9} {'/ TP 1':>7} {'rank floor ms':>14} {'/ floor':>8}")
    for batch, row in _rows(split).items():
        base = _rows(one).get(batch)
        entry = {"batch_size": batch, "tp1_median_ms": base["median_ms"] if base else None, "median_ms": row["median_ms"],
                 "over_tp1": row["median_ms"] / base["median_ms"] if base else None,
                 "rank_weight_floor_ms": row["weight_floor_ms"], "over_rank_weight_floor": row["median_over_weight_floor"]}
        result["decode"].append(entry)
        print(f"{batch:>6} {entry['tp1_median_ms'] or float('nan'):>9.2f} {row['median_ms']:>9.2f} "
              f"{entry['over_tp1'] or float('nan'):>7.2f} {row['weight_floor_ms']:>14.3f} {row['median_over_weight_floor']:>8.2f}")
    print(f"TTFT, new image: TP 1 {result['tp1_ttft_new_image_ms']:.1f} ms, TP {size} {result['ttft_new_image_ms']:.1f} ms")
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
