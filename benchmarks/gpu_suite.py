"""Every figure a GPU must show, in one run: builds the published shapes once, runs each measurement
in its own process (memory is freed between parts, a failed part does not stop the rest), and writes
one JSON and one Markdown report with each figure, its target and whether it was met.

    python benchmarks/gpu_suite.py --out gpu-report                  # everything, on one H100/H200
    python benchmarks/gpu_suite.py --out gpu-report --only decode_and_ttft,lora --budget-minutes 10
    python benchmarks/gpu_suite.py --out dry-report --dry-run        # every part, tiny, on the CPU

Run again with the same --out and the parts that finished are kept (--rerun measures them again).
Random-weight checkpoints of the published shapes are built under --checkpoints (never commit them).
docs/gpu.md says how to read the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import operator
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The guide's two commands (docs/gpu.md), printed at the top of every report.
SETUP_COMMAND = 'python -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[test]"'
RUN_COMMAND = "python benchmarks/gpu_suite.py --out gpu-report"

# name -> (the spec in mmengine.testing, the tiny stand-in of a dry run)
CHECKPOINTS = {
    "llava_7b": ("LLAVA_1_5_7B_SPEC", "llava"),
    "qwen2_5_vl_7b": ("QWEN2_5_VL_7B_SPEC", "qwen2_5_vl"),
    "qwen3_5_9b": ("QWEN3_5_9B_SPEC", "qwen3_5"),
    "qwen3_vl_30b_a3b": ("QWEN3_VL_30B_A3B_SPEC", "qwen3_vl_moe"),
    "gemma4_dense": ("GEMMA4_DENSE_SPEC", "gemma4"),
}
WITH_MTP_HEAD = ("qwen3_5_9b",)  # checkpoints given a random multi-token-prediction head (speculative method "mtp")
# name -> (the checkpoint it quantizes, mmengine.testing.quantize's method): Qwen's FP8 blocks of 128 x 128
# (the W8A16 GEMM), compressed-tensors FP8-Dynamic per channel (W8A8 through torch._scaled_mm), GPTQ in groups
# of 128 (the W4A16 GEMM's path); a dry run quantizes the tiny stand-in in blocks and groups of 32
QUANTIZED = {
    "llava_7b_fp8": ("llava_7b", "fp8"),
    "llava_7b_fp8_dynamic": ("llava_7b", "compressed-tensors"),
    "llava_7b_w4a16": ("llava_7b", "gptq"),
    "qwen2_5_vl_7b_fp8": ("qwen2_5_vl_7b", "fp8"),
    "qwen2_5_vl_7b_w4a16": ("qwen2_5_vl_7b", "gptq"),
}
# Decode-step figures of the last H100 run (issue 26: no regression), and the 512-request image workload
DECODE_MS_BEFORE = {1: 5.7, 64: 7.8, 256: 14.4}
IMAGE_WORKLOAD_REQ_S_BEFORE = 64.0


@dataclass(frozen=True)
class Target:
    op: str  # "<=" or ">="
    bound: float

    def met(self, value: float) -> bool:
        return {"<=": operator.le, ">=": operator.ge}[self.op](value, self.bound)

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


def at_most(bound: float) -> Target:
    return Target("<=", bound)


def at_least(bound: float) -> Target:
    return Target(">=", bound)


@dataclass
class Figure:
    name: str
    value: float | None
    unit: str
    target: str  # "" when the figure is reported, not judged
    verdict: str  # pass | falls short | reported | dry run | no value


@dataclass
class Context:
    out: Path
    checkpoints: Path
    dry_run: bool
    models: dict[str, str] = field(default_factory=dict)
    part_threads: int | None = None  # OMP_NUM_THREADS of each part's process, where parts run side by side

    def output(self, part: str) -> Path:
        return self.out / "parts" / f"{part}.json"


Reading = tuple[str, Any, str, Target | None]  # (figure, value, unit, target)


@dataclass(frozen=True)
class Part:
    name: str
    issues: str
    minutes: float  # device minutes on an H100, for --budget-minutes
    needs: tuple[str, ...]  # checkpoints (CHECKPOINTS) it runs on
    args: Callable[[Context], list[str]]  # the command after `python`, on the GPU
    dry_args: Callable[[Context], list[str]]  # the same, tiny, on the CPU
    read: Callable[[dict], list[Reading]]
    writes_junit: bool = False  # the test suite: counts from pytest's JUnit XML, not a JSON file
    dry_run_skips: tuple[str, ...] = ()  # checkpoints of `needs` that the dry run's command leaves out

    def checkpoints(self, dry_run: bool) -> tuple[str, ...]:
        return tuple(name for name in self.needs if not (dry_run and name in self.dry_run_skips))


@dataclass
class PartResult:
    name: str
    issues: str
    status: str  # done | dry run | failed | skipped
    seconds: float
    command: list[str]
    figures: list[Figure]
    note: str = ""


# -- the parts --------------------------------------------------------------------------------------

def _bench(script: str, ctx: Context, part: str, *args: str) -> list[str]:
    return [str(HERE / script), *args, "--output", str(ctx.output(part))]


def _attention_reads(data: dict) -> list[Reading]:
    prefill = [r for r in data["rows"] if r["kind"] == "prefill"]
    plain = [r for r in prefill if r["context"] == 0 and 2048 <= r["new_tokens"] <= 16384] or prefill
    paged = [r for r in prefill if r["context"] > 0]
    decode = [r for r in data["rows"] if r["kind"] == "decode"]
    return [
        ("prefill 2k-16k, no prefix: slowest / flash SDPA", min(r["ratio_to_sdpa"] for r in plain), "x", at_least(0.9)),
        ("prefill over a paged prefix: slowest / SDPA", min((r["ratio_to_sdpa"] for r in paged), default=None), "x", None),
        ("decode: slowest / SDPA", min(r["ratio_to_sdpa"] for r in decode), "x", None),
    ]


def _attention(kv_heads: int, heads: int) -> tuple[Callable[[Context], list[str]], Callable[[Context], list[str]]]:
    name = f"attention_gqa{heads // kv_heads}"
    shape = ["--num-heads", str(heads), "--num-kv-heads", str(kv_heads)]
    return (lambda ctx: _bench("attention.py", ctx, name, *shape)), (lambda ctx: _bench("attention.py", ctx, name, *shape, "--cpu-check"))


def _decode_reads(data: dict) -> list[Reading]:
    rows = {r["batch_size"]: r for r in data["decode"] if r.get("steps_timed")}
    ttft = data["ttft"]
    reads: list[Reading] = []
    for batch, row in rows.items():
        before = DECODE_MS_BEFORE.get(batch)
        reads.append((f"decode step, batch {batch}", row["median_ms"], "ms", at_most(round(before * 1.05, 2)) if before else None))
        reads.append((f"decode step, batch {batch} / read floor", row["median_over_floor"], "x", None))
    reads += [
        ("TTFT, new image", ttft["new_image"]["median_ms"], "ms", at_most(40.0)),
        ("TTFT, new image / transformers", ttft.get("new_image_over_transformers"), "x", at_most(0.6)),
        ("TTFT, same request again", ttft["same_request"]["median_ms"], "ms", None),
    ]
    return reads


def _moe_reads(data: dict) -> list[Reading]:
    rows = {r["batch_size"]: r for r in data["decode"] if r.get("steps_timed")}
    reads: list[Reading] = []
    for batch, row in sorted(rows.items()):
        reads.append((f"decode step, batch {batch}", row["median_ms"], "ms", None))
        target = at_most(1.5) if batch == 1 else None
        reads.append((f"decode step, batch {batch} / read floor of the active weights", row["median_over_weight_floor"], "x", target))
    reads.append(("TTFT, new image / transformers", data["ttft"].get("new_image_over_transformers"), "x", None))
    return reads


def _qwen_reads(data: dict) -> list[Reading]:
    ttft = data["ttft"]
    return [("TTFT, new 1-megapixel image", ttft["new_image"]["median_ms"], "ms", None),
            ("TTFT, new image / transformers", ttft.get("new_image_over_transformers"), "x", at_most(0.6))] + [
        (f"decode step, batch {r['batch_size']} / read floor", r["median_over_floor"], "x", None)
        for r in data["decode"] if r.get("steps_timed")]


def _images_reads(data: dict) -> list[Reading]:
    return [("512 image requests: requests/s", data["mmengine"]["requests_per_s"], "req/s", at_least(IMAGE_WORKLOAD_REQ_S_BEFORE)),
            ("requests/s / transformers (batch 32)", data.get("speedup_requests_per_s"), "x", None)]


def _lora_reads(data: dict) -> list[Reading]:
    with_lora = [r for r in data["runs"] if r["adapters"] > 0]
    worst = max(with_lora, key=lambda r: r["decode_step_vs_no_lora"])
    return [(f"decode step with {worst['adapters']} adapters of rank {worst['rank']} / no LoRA",
             worst["decode_step_vs_no_lora"], "x", at_most(1.3))]


def _video_reads(data: dict) -> list[Reading]:
    video = data["video"]
    patches = video["clips"] * video["patches_per_clip"]
    return [("second question about a clip: TTFT", 1e3 * video["ttft_second_s"], "ms", None),
            ("second question's TTFT / first's", video["ttft_second_s"] / video["ttft_first_s"], "x", None),
            ("encoder runs per temporal patch", video["mmengine"]["encoder_runs"] / patches, "runs", at_most(1.0)),
            ("requests/s / transformers", video.get("speedup"), "x", None)]


def _tiers_reads(data: dict) -> list[Reading]:
    return [("working set 5x the device caches: both tiers / none", data["speedup"], "x", at_least(1.5)),
            ("encoder tier alone / none", data["encoder_tier"]["requests_per_s"] / data["tiers_off"]["requests_per_s"], "x", None)]


def _shared_prefix_reads(data: dict) -> list[Reading]:
    modes = data["modes"]
    arrival = modes["arrival"]["requests_per_s"]
    cascade = next(row for name, row in modes.items() if name.startswith("grouped+cascade"))
    return [("RFC #12080 shape: grouped + cascade / arrival order", cascade["requests_per_s"] / arrival, "x", at_least(2.7)),
            ("grouped + cascade: requests/s", cascade["requests_per_s"], "req/s", None),
            ("prefill tokens / minimum, grouped + cascade", cascade["prefill_over_minimum"], "x", None)]


def _serve_reads(data: dict) -> list[Reading]:
    plain = data["mmengine"]
    reads: list[Reading] = [("TTFT p50", plain["ttft_ms"]["p50"], "ms", None), ("TTFT p99", plain["ttft_ms"]["p99"], "ms", None),
                            ("inter-token latency p50", plain["itl_ms"]["p50"], "ms", None),
                            ("requests/s", plain["requests_per_s"], "req/s", None)]
    if data.get("structured"):
        reads.append(("JSON-schema decoding: inter-token overhead", data["structured"]["itl_overhead"], "x", at_most(0.10)))
    return reads


def _ray_reads(data: dict) -> list[Reading]:
    rows = {(r["replicas"], r["affinity"]): r for r in data["results"]}
    replicas = max(count for count, _ in rows)
    affine, dealt = rows[(replicas, "prefix+image")], rows[(replicas, "round-robin")]
    return [(f"{replicas} replicas, cache-affine: encoder runs per picture", affine["encoder_runs_per_image"], "runs", at_most(1.0)),
            (f"{replicas} replicas: cache-affine / round-robin requests/s", affine["requests_per_s"] / dealt["requests_per_s"], "x", None)]


def _cascade_reads(data: dict) -> list[Reading]:
    rows = data["rows"]
    misjudged = sum(1 for r in rows if (r["auto_engages"] and r["speedup"] < 1.0) or (not r["auto_engages"] and r["speedup"] > 1.1))
    return [("cascade kernel: best speedup over plain", max(r["speedup"] for r in rows), "x", None),
            ("shapes where cascade 'auto' misjudges (engages and loses, or skips a >10% win)", misjudged, "shapes", at_most(0))]


def _preprocess_reads(data: dict) -> list[Reading]:
    encoder, pool = data["encoder"], data["pool"]
    most = max(pool["workers"], key=int)
    return [("vision encoder on 1920x1080 photos", encoder["photos_per_s"], "photos/s", None),
            ("vision encoder with transformers' attention (an SDPA call per window)",
             encoder.get("photos_per_s_transformers_attention"), "photos/s", None),
            (f"front end ({most} preprocessing workers) on the same photos", encoder["front_end_photos_per_s"], "photos/s", None),
            ("front end / encoder (below 1: preprocessing is the bottleneck)", encoder["front_end_over_encoder"], "x", None),
            (f"generate() on new photos with {most} workers / transformers' processor alone",
             pool["engine"][most]["of_transformers_processor"], "x", None)]


def _online_offline_reads(data: dict) -> list[Reading]:
    """Judged against generate() at the clients' concurrency: the same batch width, so the ratio is the server's own
    cost. All at once, generate() runs steps twice as wide as 32 clients can fill; where a step's cost barely follows
    its width (the tiny model on a GPU), that alone holds the server near half of it, so that ratio is reported only."""
    row = data["online_offline"]
    concurrency = row["concurrency"]
    reads: list[Reading] = [("offline, generate() all at once", row["offline_all_at_once"]["requests_per_s"], "req/s", None),
                            (f"offline, generate() at concurrency {concurrency}", row["offline_at_concurrency"]["requests_per_s"],
                             "req/s", None)]
    for side in row["online"]:
        count = side["api_server_count"]
        reads += [(f"online, api-server-count {count}", side["requests_per_s"], "req/s", None),
                  (f"online / offline all at once, api-server-count {count}", side["ratio_vs_all_at_once"], "x", None),
                  (f"engine steps per request, api-server-count {count}", side.get("engine_steps_per_request"), "", None)]
        for role, ms in (side.get("cpu_ms_per_request_by_role") or {}).items():  # where the server's CPU goes
            reads.append((f"server CPU per request, {role}, api-server-count {count}", ms, "ms", None))
    best = max(row["online"], key=lambda side: side["ratio_vs_at_concurrency"])
    reads.append((f"online / offline at concurrency {concurrency}, best (api-server-count {best['api_server_count']})",
                  best["ratio_vs_at_concurrency"], "x", at_least(0.9)))
    return reads


def _online_offline_args(ctx: Context) -> list[str]:
    """The tiny model's one-image chats on the GPU, the server with 1 and 4 front ends; the server's processes (and
    the offline engine) on half the CPUs and the 32 clients on the other half, so the clients' CPU is not the server's."""
    args = ["--online-offline", "--device", "cuda", "--dtype", "float32", "--num-requests", "1024", "--api-server-count", "1,4",
            "--allow-text-mismatch"]  # (token counts are still compared; a GEMM's reduction order may follow the batch shape)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) >= 4:
        half = len(cpus) // 2
        args += ["--server-cpus", ",".join(map(str, cpus[:half])), "--client-cpus", ",".join(map(str, cpus[half:]))]
    return _bench("serve.py", ctx, "online_offline", *args)


def _gemma4_reads(data: dict) -> list[Reading]:
    ttft = data["ttft"]
    return [("TTFT, new image", ttft["new_image"]["median_ms"], "ms", None),
            ("TTFT, new image / transformers", ttft.get("new_image_over_transformers"), "x", at_most(1.0))] + [
        (f"decode step, batch {r['batch_size']}", r["median_ms"], "ms", None)
        for r in data["decode"] if r.get("steps_timed")]


def _window_pool_reads(data: dict) -> list[Reading]:
    modes = data["modes"]
    every, windowed = modes["every layer"], modes["window pool 0.5"]
    prefixes = data["args"]["prefixes"]
    return [("KV bytes per token of context, window pool 0.5 / every layer",
             windowed["kv_bytes_per_context_token"] / every["kv_bytes_per_context_token"], "x", at_most(0.8)),
            ("prompts cached on the second pass, every layer", every["second_pass"]["prompts_hit"], "of " + str(prefixes), None),
            ("prompts cached on the second pass, window pool 0.5", windowed["second_pass"]["prompts_hit"], "of " + str(prefixes),
             at_least(prefixes))]


def _speculative_reads(data: dict) -> list[Reading]:
    """Verify steps against graphed decodes: random weights rarely repeat their prompt, so the n-gram row is
    the cost of rejected drafts; the oracle row (every draft right) bounds what acceptance can give."""
    runs = data["runs"]
    return [("n-gram drafts: tok/s / without", runs["ngram"]["speedup"], "x", None),
            ("n-gram acceptance (random weights)", runs["ngram"]["acceptance"] or 0.0, "share", None),
            ("every draft right (oracle): tok/s / without", runs["oracle"]["speedup"], "x", None),
            ("every draft right: decode steps / without", runs["oracle"]["decode_steps"] / runs["off"]["decode_steps"], "x", None),
            ("answers equal with and without", int(data["answers_equal"]), "1 = yes", None)]


def _spec_decode_reads(data: dict) -> list[Reading]:
    """The MTP head's cost: its random weights draft nothing right, so each step is a k+1-token verify step
    plus the head's forward, against a 1-token (graphed) decode; below 1 + acceptance x k it pays."""
    runs = data["runs"]
    return [("MTP step (k+1-token verify + head) / 1-token decode", runs["mtp"]["step_cost"], "x", None),
            ("every draft right (oracle): verify step / decode", runs["oracle"]["step_cost"], "x", None),
            ("verify steps replayed from CUDA graphs (oracle run)", runs["oracle"].get("verify_graph_replays", 0), "steps", None),
            ("every draft right: tok/s / without", runs["oracle"]["speedup"], "x", None),
            ("answers equal with and without", int(data["answers_equal"]), "1 = yes", None)]


def _tp_reads(data: dict) -> list[Reading]:
    """Issue 48: the decode step at TP N against one rank's weight-read floor (target <= 1.25x) and against TP 1.
    With fewer GPUs than ranks the script ran nothing and says so."""
    if "skipped" in data:
        return [(f"skipped: {data['skipped']}", data["gpus"], "GPUs", None)]
    size = data["tensor_parallel_size"]
    reads: list[Reading] = []
    for row in data["decode"]:
        batch = row["batch_size"]
        reads.append((f"TP {size} decode step, batch {batch} / one rank's weight floor", row["over_rank_weight_floor"], "x",
                      at_most(1.25)))
        reads.append((f"TP {size} decode step, batch {batch} / TP 1's", row["over_tp1"], "x", None))
    reads.append((f"TTFT new image, TP {size} / TP 1", data["ttft_new_image_ms"] / data["tp1_ttft_new_image_ms"], "x", None))
    return reads


def _hybrid_reads(data: dict) -> list[Reading]:
    runs = data["runs"]
    chat_on, chat_off = runs["chat / prefix caching on"], runs["chat / prefix caching off"]
    system_on, system_off = runs["system / prefix caching on"], runs["system / prefix caching off"]

    def ratio(run: dict) -> float:
        return run["prefill_tokens_computed"] / run["prefill_tokens_minimum"]

    return [("multi-turn image chat: prefill tokens / minimum", ratio(chat_on), "x", None),
            ("... prefix caching off (vLLM below 528 tokens)", ratio(chat_off), "x", None),
            ("multi-turn image chat: TTFT last turn / first", chat_on["ttft_last_over_first"], "x", None),
            ("... prefix caching off", chat_off["ttft_last_over_first"], "x", None),
            ("shared system prompt: prefill tokens / minimum", ratio(system_on), "x", None),
            ("... prefix caching off", ratio(system_off), "x", None),
            ("bytes per state checkpoint", chat_on["state_checkpoint_bytes"], "bytes", None)]


def _quantized_reads(data: dict) -> list[Reading]:
    """Issue 36's targets on an H100: W4A16 batch-1 decode <= 0.4x bf16's, FP8 <= 0.6x; FP8 req/s >= 1.3x."""
    reads: list[Reading] = []
    for label, decode_target, rate_target in (("w4a16", 0.4, None), ("fp8", 0.6, 1.3), ("fp8_dynamic", 0.6, 1.3)):
        if label not in data["ratios"]:
            continue
        ratios, row = data["ratios"][label], data["results"][label]
        for batch, ratio in ratios["decode_step_over_bf16"].items():
            reads.append((f"{label}: decode step, batch {batch} / bf16", ratio, "x", at_most(decode_target) if batch == "1" else None))
            reads.append((f"{label}: decode step, batch {batch} / its read floor", row["decode"][batch]["over_floor"], "x", None))
        if "requests_per_s_over_bf16" in ratios:
            reads.append((f"{label}: image workload requests/s / bf16", ratios["requests_per_s_over_bf16"], "x",
                          at_least(rate_target) if rate_target else None))
    return reads


def _quantized_part(name: str, source: str, minutes: int, images: bool, labels: tuple[str, ...] = ("fp8", "w4a16")) -> Part:
    """benchmarks/quantized.py on `source` and its quantized copies `labels` (decode at batch 1 and 64; with
    `images`, the 512-request image workload too)."""
    extra = ["--images"] if images else []
    dry_run_skips = (f"{source}_fp8_dynamic",)  # on the CPU FP8-Dynamic runs W8A16, as the FP8 variant does

    def args(ctx: Context, tiny: bool) -> list[str]:
        used = [label for label in labels if not (tiny and f"{source}_{label}" in dry_run_skips)]
        variants = [arg for label in used for arg in ("--variant", f"{label}={_model(ctx, f'{source}_{label}')}")]
        sizes = ["--device", "cpu", "--batch-sizes", "1,3", "--max-model-len", "512", "--tiny", "--num-requests", "6"] if tiny \
            else ["--device", "cuda", "--batch-sizes", "1,64"]
        return _bench("quantized.py", ctx, name, "--model", _model(ctx, source), *variants, *sizes, *extra)

    return Part(name, "36", minutes, (source, *(f"{source}_{label}" for label in labels)), lambda ctx: args(ctx, False),
                lambda ctx: args(ctx, True), _quantized_reads, dry_run_skips=dry_run_skips)


def _tests_reads(data: dict) -> list[Reading]:
    return [("tests failed or in error", data["failed"] + data["errors"], "tests", at_most(0)),
            ("tests passed", data["passed"], "tests", None), ("tests skipped", data["skipped"], "tests", None)]


def _tests_args(ctx: Context) -> list[str]:
    workers = ["-n", "8"] if _has_xdist() else []
    return ["-m", "pytest", "-q", *workers, "--junit-xml", str(ctx.output("tests").with_suffix(".xml"))]


def _model(ctx: Context, name: str) -> str:
    return ctx.models[name]


_GPU_ATTENTION_4, _DRY_ATTENTION_4 = _attention(kv_heads=8, heads=32)
_GPU_ATTENTION_7, _DRY_ATTENTION_7 = _attention(kv_heads=4, heads=28)
_TINY_LATENCY = ["--batch-sizes", "1,3", "--prompt-tokens", "16", "--warmup-steps", "1", "--decode-steps", "3",
                 "--ttft-repeats", "1", "--image-size", "64x48", "--profile-batch-size", "2", "--profile-steps", "1",
                 "--max-model-len", "512", "--transformers-ttft"]

def _latency_part(name: str, issue: str, minutes: int, image_size: str, reads: Callable[[dict], list[Reading]]) -> Part:
    """`latency.py` on the checkpoint `name` (decode at batch 1 and 64, TTFT beside transformers'), tiny in a dry run."""
    return Part(name, issue, minutes, (name,),
                lambda ctx: _bench("latency.py", ctx, name, "--model", _model(ctx, name), "--device", "cuda", "--batch-sizes", "1,64",
                                   "--image-size", image_size, "--max-model-len", "8192", "--transformers-ttft"),
                lambda ctx: _bench("latency.py", ctx, name, "--model", _model(ctx, name), *_TINY_LATENCY),
                reads)


PARTS: list[Part] = [
    Part("attention_gqa4", "26", 3, (), _GPU_ATTENTION_4, _DRY_ATTENTION_4, _attention_reads),
    Part("attention_gqa7", "26", 3, (), _GPU_ATTENTION_7, _DRY_ATTENTION_7, _attention_reads),
    Part("decode_and_ttft", "26", 4, ("llava_7b",),
         lambda ctx: _bench("latency.py", ctx, "decode_and_ttft", "--model", _model(ctx, "llava_7b"), "--device", "cuda",
                            "--batch-sizes", "1,64,256", "--image-size", "640x480", "--max-model-len", "4096",
                            "--transformers-ttft"),
         # (tests/test_benchmarks.py runs this dry command in-process and reads it as the part does)
         lambda ctx: _bench("latency.py", ctx, "decode_and_ttft", "--model", _model(ctx, "llava_7b"), *_TINY_LATENCY),
         _decode_reads),
    Part("image_workload", "26", 6, ("llava_7b",),
         lambda ctx: _bench("throughput.py", ctx, "image_workload", "--model", _model(ctx, "llava_7b"), "--device", "cuda",
                            "--num-requests", "512", "--unique-images", "64", "--image-fraction", "1", "--image-size-max", "640",
                            "--prompt-words", "40", "--prompt-words-min", "40", "--output-len", "128", "--max-num-seqs", "256",
                            "--max-num-batched-tokens", "8192", "--max-model-len", "4096", "--baseline-batch-size", "32",
                            "--baseline-requests", "64"),
         # (tests/test_benchmarks.py runs this dry command in-process and reads it as the part does)
         lambda ctx: _bench("throughput.py", ctx, "image_workload", "--model", _model(ctx, "llava_7b"), "--num-requests", "6",
                            "--unique-images", "2", "--image-fraction", "0.5", "--image-size-max", "64", "--prompt-words", "6",
                            "--output-len", "3", "--max-num-seqs", "4", "--max-model-len", "256", "--baseline-batch-size", "3",
                            "--baseline-requests", "4"),
         _images_reads),
    _latency_part("qwen2_5_vl_7b", "26", 4, "1155x866", _qwen_reads),
    Part("lora", "22", 3, ("llava_7b",),
         lambda ctx: _bench("lora.py", ctx, "lora", "--model", _model(ctx, "llava_7b"), "--device", "cuda", "--adapters", "0,8",
                            "--ranks", "16", "--max-loras", "8", "--num-requests", "64", "--decode-batch-size", "64",
                            "--decode-steps", "20", "--output-len", "32"),
         # (tests/test_benchmarks.py runs this dry command in-process and reads it as the part does)
         lambda ctx: _bench("lora.py", ctx, "lora", "--model", _model(ctx, "llava_7b"), "--adapters", "0,1,3", "--ranks", "4,8",
                            "--num-requests", "6", "--unique-images", "2", "--output-len", "3", "--decode-batch-size", "3",
                            "--decode-steps", "2", "--max-model-len", "256"),
         _lora_reads),
    Part("video", "24", 4, ("qwen2_5_vl_7b",),
         lambda ctx: _bench("encoder_cache.py", ctx, "video", "--scenarios", "video", "--video-model", _model(ctx, "qwen2_5_vl_7b"),
                            "--device", "cuda", "--num-clips", "2", "--num-requests", "8", "--clip-seconds", "30",
                            "--clip-size", "448x448", "--video-max-model-len", "16384", "--output-len", "16"),
         lambda ctx: _bench("encoder_cache.py", ctx, "video", "--scenarios", "video", "--video-model", _model(ctx, "qwen2_5_vl_7b"),
                            "--device", "cpu", "--dtype", "float32", "--num-requests", "3", "--num-clips", "2",
                            "--clip-seconds", "3", "--output-len", "2"),
         _video_reads),
    Part("tiers", "25", 3, ("llava_7b",),
         lambda ctx: _bench("tiered_cache.py", ctx, "tiers", "--model", _model(ctx, "llava_7b"), "--device", "cuda"),
         lambda ctx: _bench("tiered_cache.py", ctx, "tiers", "--model", _model(ctx, "llava_7b"), "--device", "cpu",
                            "--working-set", "1.5", "--rounds", "2", "--image-size", "48", "--max-model-len", "256",
                            "--timing-repeats", "1", "--num-kv-blocks", "8", "--max-num-batched-tokens", "64",
                            "--document-words", "24"),
         _tiers_reads),
    Part("shared_prefix", "27", 5, ("llava_7b",),
         lambda ctx: _bench("shared_prefix.py", ctx, "shared_prefix", "--model", _model(ctx, "llava_7b"), "--device", "cuda",
                            "--groups", "16", "--degree", "32", "--shared-len", "2020", "--unique-len", "200",
                            "--output-len", "100", "--modes", "arrival,grouped+cascade"),
         lambda ctx: _bench("shared_prefix.py", ctx, "shared_prefix", "--model", _model(ctx, "llava_7b"), "--groups", "2",
                            "--degree", "3", "--shared-len", "40", "--unique-len", "8", "--output-len", "2",
                            "--num-kv-blocks", "12", "--block-size", "8", "--modes", "arrival,grouped+cascade"),
         _shared_prefix_reads),
    Part("cascade_kernel", "27", 2, (),
         lambda ctx: _bench("cascade_attention.py", ctx, "cascade_kernel", "--members", "1,2,4,8,16,32"),
         lambda ctx: _bench("cascade_attention.py", ctx, "cascade_kernel", "--tiny", "--members", "1,3"),
         _cascade_reads),
    Part("serve", "27", 4, ("llava_7b",),
         lambda ctx: _bench("serve.py", ctx, "serve", "--model", _model(ctx, "llava_7b"), "--device", "cuda", "--num-users", "64",
                            "--turns", "2", "--output-len", "128", "--skip-baseline", "--structured"),
         lambda ctx: _bench("serve.py", ctx, "serve", "--model", _model(ctx, "llava_7b"), "--server", "thread", "--num-users", "2",
                            "--turns", "1", "--num-pictures", "1", "--output-len", "8", "--image-size", "64x48",
                            "--max-model-len", "256", "--skip-baseline", "--structured"),
         _serve_reads),
    Part("ray", "27", 4, ("llava_7b",),
         lambda ctx: _bench("ray_batch.py", ctx, "ray", "--model", _model(ctx, "llava_7b"), "--replicas", "2", "--num-gpus", "0.5",
                            "--gpu-memory-utilization", "0.42", "--images", "16", "--per-image", "16", "--output-len", "32",
                            "--repeats", "1", "--max-model-len", "4096"),
         lambda ctx: _bench("ray_batch.py", ctx, "ray", "--model", _model(ctx, "llava_7b"), "--replicas", "2", "--images", "2",
                            "--per-image", "2", "--groups", "1", "--degree", "2", "--shared-len", "16", "--unique-len", "8",
                            "--output-len", "2", "--repeats", "1", "--num-cpus", "0.5", "--max-model-len", "256"),
         _ray_reads),
    _latency_part("qwen3_vl_30b_a3b", "34", 6, "640x480", _moe_reads),
    Part("qwen3_5_9b", "33", 4, ("qwen3_5_9b",),
         lambda ctx: _bench("hybrid_prefix.py", ctx, "qwen3_5_9b", "--model", _model(ctx, "qwen3_5_9b"), "--device", "cuda",
                            "--turns", "4", "--output-len", "128", "--system-len", "2000", "--tail-len", "200",
                            "--picture-size", "896"),
         lambda ctx: _bench("hybrid_prefix.py", ctx, "qwen3_5_9b", "--model", _model(ctx, "qwen3_5_9b"), "--device", "cpu",
                            "--dtype", "float32", "--turns", "3", "--output-len", "5", "--requests", "4", "--system-len", "40",
                            "--tail-len", "6", "--picture-size", "64"),
         _hybrid_reads),
    Part("speculative", "49", 3, ("qwen3_5_9b",),
         lambda ctx: _bench("spec_decode.py", ctx, "speculative", "--model", _model(ctx, "qwen3_5_9b"), "--device", "cuda",
                            "--num-prompts", "16", "--passage-len", "64", "--output-len", "128"),
         lambda ctx: _bench("spec_decode.py", ctx, "speculative", "--model", _model(ctx, "qwen3_5_9b"), "--device", "cpu",
                            "--dtype", "float32", "--num-prompts", "2", "--passage-len", "6", "--output-len", "9"),
         _speculative_reads),
    Part("spec_decode", "49", 3, ("qwen3_5_9b",),
         lambda ctx: _bench("spec_decode.py", ctx, "spec_decode", "--model", _model(ctx, "qwen3_5_9b"), "--device", "cuda",
                            "--method", "mtp", "--num-prompts", "16", "--passage-len", "64", "--output-len", "128"),
         lambda ctx: _bench("spec_decode.py", ctx, "spec_decode", "--model", _model(ctx, "qwen3_5_9b"), "--device", "cpu",
                            "--dtype", "float32", "--method", "mtp", "--num-prompts", "2", "--passage-len", "6", "--output-len", "9"),
         _spec_decode_reads),
    _latency_part("gemma4_dense", "35", 5, "640x480", _gemma4_reads),
    Part("gemma4_window_pool", "35", 3, ("gemma4_dense",),
         lambda ctx: _bench("window_pool.py", ctx, "gemma4_window_pool", "--model", _model(ctx, "gemma4_dense"), "--device",
                            "cuda", "--kv-blocks", "2048", "--prefixes", "16", "--prompt-len", "2048", "--max-model-len", "8192",
                            "--max-num-batched-tokens", "2048", "--ratios", "0.5"),
         lambda ctx: _bench("window_pool.py", ctx, "gemma4_window_pool", "--model", _model(ctx, "gemma4_dense"), "--device",
                            "cpu", "--dtype", "float32", "--kv-blocks", "16", "--prefixes", "6", "--prompt-len", "48",
                            "--max-model-len", "256", "--max-num-batched-tokens", "80", "--ratios", "0.5"),
         _window_pool_reads),
    _quantized_part("quantized_llava_7b", "llava_7b", 10, images=True, labels=("fp8", "fp8_dynamic", "w4a16")),
    _quantized_part("quantized_qwen2_5_vl_7b", "qwen2_5_vl_7b", 5, images=False),
    Part("preprocess", "47", 3, ("qwen2_5_vl_7b",),
         lambda ctx: _bench("preprocess.py", ctx, "preprocess", "--families", "qwen2.5", "--photos", "12", "--workers", "1,8",
                            "--encoder-model", _model(ctx, "qwen2_5_vl_7b"), "--device", "cuda"),
         # (tests/test_benchmarks.py runs this dry command in-process and reads it as the part does)
         lambda ctx: _bench("preprocess.py", ctx, "preprocess", "--families", "llava", "--photos", "1", "--repeats", "1",
                            "--sizes", "320x240,640x480", "--workers", "1", "--encoder-model", _model(ctx, "qwen2_5_vl_7b"),
                            "--device", "cpu"),
         _preprocess_reads),
    Part("online_offline", "47", 3, (), _online_offline_args,
         # (tests/test_serve_benchmark.py runs this dry command in-process and reads it as the part does)
         lambda ctx: _bench("serve.py", ctx, "online_offline", "--online-offline", "--server", "thread", "--num-requests", "4",
                            "--concurrency", "2", "--num-pictures", "2", "--output-len", "3", "--image-size", "64x48",
                            "--max-model-len", "256"),
         _online_offline_reads),
    Part("tp", "48", 4, ("llava_7b",),
         lambda ctx: _bench("tensor_parallel.py", ctx, "tp", "--model", _model(ctx, "llava_7b"), "--device", "cuda",
                            "--tensor-parallel-size", "2", "--batch-sizes", "1,64", "--max-model-len", "4096",
                            "--gpu-memory-utilization", "0.8"),
         # (tests/test_benchmarks.py runs this dry command in-process and reads it as the part does)
         lambda ctx: _bench("tensor_parallel.py", ctx, "tp", "--model", _model(ctx, "llava_7b"), "--device", "cpu", "--dtype",
                            "float32", "--tensor-parallel-size", "2", *(a for a in _TINY_LATENCY if a != "--transformers-ttft")),
         _tp_reads),
    Part("tests", "27", 8, (), _tests_args,
         lambda ctx: ["-m", "pytest", "-q", "--noconftest", "tests/test_import_graph.py", "--junit-xml",
                      str(ctx.output("tests").with_suffix(".xml"))],
         _tests_reads, writes_junit=True),
]


# -- running them -----------------------------------------------------------------------------------

def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def junit_counts(path: Path) -> dict[str, int]:
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"], "failed": total["failures"],
            "errors": total["errors"], "skipped": total["skipped"]}


def ensure_checkpoints(part: Part, ctx: Context, log: Path) -> None:
    """The checkpoints `part` runs on: the published shapes built once under --checkpoints (random bf16
    weights, on the GPU), or in a dry run the tiny stand-ins."""
    for name in part.checkpoints(ctx.dry_run):
        if name in ctx.models:
            continue
        if name in QUANTIZED:
            ctx.models[name] = _quantized_checkpoint(name, ctx, log)
            continue
        spec, tiny_family = CHECKPOINTS[name]
        if ctx.dry_run:
            from mmengine.testing import TinyGemma4Spec, TinyLlavaSpec, tiny_gemma4_path, tiny_llava_path, tiny_qwen_vl_path
            from mmengine.testing.qwen_vl import tiny_spec

            if tiny_family == "gemma4":
                path = tiny_gemma4_path(TinyGemma4Spec())
            elif name in WITH_MTP_HEAD:
                from mmengine.testing.mtp import tiny_qwen3_5_mtp_path

                path = tiny_qwen3_5_mtp_path(tiny_family)
            else:
                path = tiny_llava_path(TinyLlavaSpec()) if tiny_family == "llava" else tiny_qwen_vl_path(tiny_spec(tiny_family))
        else:
            path = ctx.checkpoints / name
            code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); from pathlib import Path; from latency import ensure_checkpoint; "
                    f"import mmengine.testing as t; print(ensure_checkpoint(Path({str(path)!r}), t.{spec}, 'cuda', 'bfloat16')[1])")
            if name in WITH_MTP_HEAD:  # a random MTP head beside the weights (the plain engine skips it)
                code += (f"; from mmengine.testing.mtp import add_mtp_head; p = Path({str(path)!r}); "
                         "(p / 'mtp.safetensors').exists() or add_mtp_head(p)")
            with log.open("a") as sink:
                subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, check=True)
        ctx.models[name] = str(path)


def _quantized_checkpoint(name: str, ctx: Context, log: Path) -> str:
    """The quantized copy `name` of a checkpoint the parts run on (built before it, as `needs` lists it)."""
    source, method = QUANTIZED[name]
    path = ctx.checkpoints / name
    if (path / "config.json").is_file():
        return str(path)
    size, device = (32, "cpu") if ctx.dry_run else (128, "cuda")
    if ctx.dry_run:  # tiny and on the CPU: in this process (no device memory to free, no interpreter to start)
        from mmengine.testing.quantize import quantize_checkpoint

        partial = Path(str(path) + ".partial")
        quantize_checkpoint(Path(ctx.models[source]), partial, method, block=(size, size), group_size=size, reference=False,
                            device=device)
        partial.rename(path)
        return str(path)
    code = (f"from pathlib import Path; from mmengine.testing.quantize import quantize_checkpoint; "
            f"quantize_checkpoint(Path({ctx.models[source]!r}), Path({str(path)!r} + '.partial'), {method!r}, "
            f"block=({size}, {size}), group_size={size}, reference=False, device={device!r}); "
            f"Path({str(path)!r} + '.partial').rename({str(path)!r})")
    with log.open("a") as sink:
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, check=True)
    return str(path)


def run_part(part: Part, ctx: Context, timeout_s: float) -> PartResult:
    log = ctx.out / "logs" / f"{part.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    start = time.perf_counter()
    command: list[str] = []
    try:
        ensure_checkpoints(part, ctx, log)
        command = [sys.executable, *(part.dry_args if ctx.dry_run else part.args)(ctx)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        if ctx.part_threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(ctx.part_threads))
        with log.open("a") as sink:
            sink.write("$ " + " ".join(command) + "\n")
            sink.flush()
            done = subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
        if part.writes_junit:
            data = junit_counts(ctx.output(part.name).with_suffix(".xml"))
        else:
            if done.returncode != 0:
                raise RuntimeError(f"exit status {done.returncode}")
            data = json.loads(ctx.output(part.name).read_text())
        figures = [judge(name, value, unit, target, ctx.dry_run) for name, value, unit, target in part.read(data)]
        status = "dry run" if ctx.dry_run else "done"
        return PartResult(part.name, part.issues, status, time.perf_counter() - start, command, figures)
    except Exception as err:  # noqa: BLE001 - a failed part is recorded and the suite goes on
        tail = log.read_text()[-600:] if log.exists() else ""
        return PartResult(part.name, part.issues, "failed", time.perf_counter() - start, command, [],
                          f"{type(err).__name__}: {err} (log: {log}) {tail[-300:]!r}")


def judge(name: str, value: Any, unit: str, target: Target | None, dry_run: bool) -> Figure:
    if value is None:
        return Figure(name, None, unit, str(target or ""), "no value")
    value = float(value)
    if dry_run:
        verdict = "dry run"
    elif target is None:
        verdict = "reported"
    else:
        verdict = "pass" if target.met(value) else "falls short"
    return Figure(name, value, unit, str(target or ""), verdict)


# -- the report -------------------------------------------------------------------------------------

def header(dry_run: bool) -> dict[str, str]:
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        gpu = "none"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"gpu": gpu if not dry_run else f"{gpu} (dry run on the CPU)", "commit": (commit or "unknown") + (" (modified)" if dirty.strip() else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "mode": "dry run" if dry_run else "full", "setup": SETUP_COMMAND, "run": RUN_COMMAND}


def markdown(head: dict[str, str], results: list[PartResult]) -> str:
    lines = ["# mmengine GPU suite", "", f"GPU: {head['gpu']} · commit {head['commit']} · {head['date']} · {head['mode']}", "",
             f"Set up: `{head['setup']}`", "", f"Run: `{head['run']}`", "",
             "| part | issues | figure | value | target | verdict |", "|---|---|---|---|---|---|"]
    for result in results:
        if not result.figures:
            lines.append(f"| {result.name} | {result.issues} | | | | {result.status}: {result.note[:120]} |")
        for fig in result.figures:
            value = "" if fig.value is None else f"{fig.value:.3g} {fig.unit}"
            lines.append(f"| {result.name} | {result.issues} | {fig.name} | {value} | {fig.target} | {fig.verdict} |")
    lines += ["", "| part | status | seconds | command |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} | `{' '.join(r.command[1:])}` |" for r in results]
    return "\n".join(lines) + "\n"


def write_report(out: Path, head: dict[str, str], results: list[PartResult]) -> None:
    (out / "report.json").write_text(json.dumps({"header": head, "parts": [asdict(r) for r in results]}, indent=2))
    (out / "report.md").write_text(markdown(head, results))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-report", help="the report, each part's JSON and log (kept across runs)")
    parser.add_argument("--checkpoints", default=None, help="where the published shapes are built (default: OUT/checkpoints)")
    parser.add_argument("--only", default=None, help="comma-separated parts to run (default: all; --list names them)")
    parser.add_argument("--budget-minutes", type=float, default=25.0,
                        help="skip a part whose estimated minutes no longer fit (the checkpoint builds count as they go; "
                             "default: 25)")
    parser.add_argument("--dry-run", action="store_true", help="every part on tiny checkpoints on the CPU: checks the suite")
    parser.add_argument("--rerun", action="store_true", help="measure again the parts an earlier run of this --out finished")
    parser.add_argument("--jobs", type=int, default=1, help="with --dry-run: parts run this many at a time")
    parser.add_argument("--list", action="store_true", help="print the parts and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for part in PARTS:
            print(f"{part.name:<16} issue {part.issues:<4} ~{part.minutes:g} min  on {', '.join(part.needs) or 'no checkpoint'}")
        return 0
    names = [name.strip() for name in args.only.split(",")] if args.only else [part.name for part in PARTS]
    unknown = sorted(set(names) - {part.name for part in PARTS})
    if unknown:
        print(f"unknown part(s) {unknown}; known: {[part.name for part in PARTS]}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    (out / "parts").mkdir(parents=True, exist_ok=True)
    ctx = Context(out, Path(args.checkpoints).resolve() if args.checkpoints else out / "checkpoints", args.dry_run)
    earlier = _earlier_results(out, args.dry_run) if not args.rerun else {}
    head, results, start = header(args.dry_run), [], time.perf_counter()
    selected = [p for p in PARTS if p.name in names]
    if args.dry_run and args.jobs > 1:
        results = _dry_run_in_parallel(selected, ctx, earlier, args.jobs)
        write_report(out, head, results)
        selected = []
    for part in selected:  # one at a time: on a GPU each part has the device to itself
        left = args.budget_minutes - (time.perf_counter() - start) / 60
        if part.name in earlier:
            result = earlier[part.name]
        elif part.minutes > left and not args.dry_run:
            result = PartResult(part.name, part.issues, "skipped", 0.0, [], [], f"~{part.minutes:g} min left the budget ({left:.1f} min)")
        else:
            print(f"== {part.name} (issue {part.issues}, ~{part.minutes:g} min)", flush=True)
            result = run_part(part, ctx, timeout_s=max(60.0, 60 * min(2 * part.minutes, max(left, part.minutes))))
        results.append(result)
        write_report(out, head, results)  # after every part: a killed run keeps what finished
    print(markdown(head, results))
    print(f"wrote {out / 'report.md'} and {out / 'report.json'}")
    return 1 if any(r.status == "failed" for r in results) else 0


def _dry_run_in_parallel(parts: list[Part], ctx: Context, earlier: dict[str, PartResult], jobs: int) -> list[PartResult]:
    """A dry run's parts, `jobs` at a time (tiny and on the CPU, they share nothing but the cores; their
    process start-up dominates). The checkpoints are built first, one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    todo = [part for part in parts if part.name not in earlier]
    # OpenMP threads that outnumber the cores spin-wait for one another: a tiny model's steps slow down many times
    ctx.part_threads = max(1, (os.cpu_count() or 1) // jobs)
    (ctx.out / "logs").mkdir(parents=True, exist_ok=True)
    for part in todo:
        ensure_checkpoints(part, ctx, ctx.out / "logs" / f"{part.name}.log")
    with ThreadPoolExecutor(jobs) as pool:
        done = dict(zip((p.name for p in todo), pool.map(lambda part: run_part(part, ctx, timeout_s=600.0), todo)))
    return [earlier.get(part.name) or done[part.name] for part in parts]


def _earlier_results(out: Path, dry_run: bool) -> dict[str, PartResult]:
    """Parts a previous run of this --out finished in the same mode (kept unless --rerun)."""
    path = out / "report.json"
    if not path.exists():
        return {}
    finished = "dry run" if dry_run else "done"
    kept = {}
    for part in json.loads(path.read_text())["parts"]:
        if part["status"] == finished:
            part["figures"] = [Figure(**fig) for fig in part["figures"]]
            kept[part["name"]] = PartResult(**part)
    return kept


if __name__ == "__main__":
    sys.exit(main())
