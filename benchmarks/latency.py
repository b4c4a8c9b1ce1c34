"""Latency: decode step time per batch size next to the memory-read floor, time to first token, and
the share of a decode step the GPU is busy.

    python benchmarks/latency.py                               # built-in tiny model, a quick CPU run
    python benchmarks/latency.py --build-7b /tmp/llava-1.5-7b  # LLaVA-1.5-7B shape, random bf16 weights
    python benchmarks/latency.py --family qwen2_5_vl --build-7b /tmp/qwen2.5-vl-7b  # Qwen2.5-VL-7B shape
    python benchmarks/latency.py --model PATH --batch-sizes 1,16,64,256

Decode: per batch size, that many text requests (128-token prompts) are prefilled, then steady decode
steps (every request gets a token, nothing is prefilled) are timed as the intervals between
consecutive step() returns (with async scheduling a step's host work overlaps the previous step on
the device, so nothing is synchronized in between). The floor is what such a step must read from memory divided by the memory bandwidth: the
decoder's weights (not the vision tower, not the embedding table, of which a step reads one row per
request), plus the batch's KV cache. The bandwidth is measured with a large device-to-device copy
unless --bandwidth-gbs gives it.

TTFT (generate with max_tokens=1, preprocessing included) for a new image, for the same request
again (full prefix and encoder cache hit), and for the same image with a new question (encoder hit,
the prefix up to the question cached). Shapes are warmed up first, so no JIT is timed.

GPU-busy share: torch.profiler over steady decode steps; the device's busy time (the union of its
kernel and copy intervals) over the stretch of its timeline those steps cover, so idle gaps between
kernels (the host not keeping up) are what lowers it. Kernels per step are counted too.

--build-7b DIR builds the family's 7B-shaped checkpoint there if it is missing (directly on the GPU
in bf16, about 20 s and 14-17 GB of disk; never commit it). Prompts go through the model's chat
template, so every family is asked the same questions.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mmengine import MMEngine, SamplingParams
from mmengine.config import EngineConfig
from mmengine.testing import (
    LLAVA_1_5_7B_SPEC,
    TinyGemma4Spec,
    build_gemma4_checkpoint,
    QWEN2_5_VL_7B_SPEC,
    QWEN3_VL_30B_A3B_SPEC,
    TinyLlavaSpec,
    build_llava_checkpoint,
    build_qwen_vl_checkpoint,
    make_test_image,
    tiny_llava_path,
    tiny_qwen_vl_path,
)
from mmengine.testing.qwen_vl import tiny_spec  # noqa: E402

WORDS = ("the a picture of small large red blue green cat dog boat house tree river sky cloud road "
         "man woman child table window book car street bird water light morning").split()
SYSTEM = "A chat between a curious human and an artificial intelligence assistant. " * 4
QUESTIONS = ("What is shown in this picture? Describe it in detail.", "How many animals are there, and what colour are they?")


def image_question(engine: MMEngine, question: str) -> str:
    """A system prompt, one image and `question`, in the model's chat template."""
    return engine.input_processor.apply_chat_template([
        {"role": "system", "content": SYSTEM.strip()},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
    ])


def run_record(model: str, origin: dict, args: argparse.Namespace) -> dict:
    """What a result file says first: the checkpoint and how it came about, the device, the settings."""
    device = "cuda" if torch.cuda.is_available() and getattr(args, "device", "auto") != "cpu" else "cpu"
    return {"model": model, **origin, "device": device, "settings": {k: v for k, v in vars(args).items() if k != "output"}}


def write_json(output: str, result: dict) -> None:
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {output}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- checkpoint -----------------------------------------------------------------------------------


def ensure_checkpoint(path: Path, spec: object, device: str, dtype: str) -> tuple[Path, float]:
    """`path` if it holds a checkpoint, else builds one there (in a sibling directory renamed into
    place, so an interrupted build is never mistaken for a finished one). Returns (path, build seconds)."""
    if (path / "config.json").is_file():
        return path, 0.0
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    start = time.perf_counter()
    if isinstance(spec, TinyGemma4Spec):
        build_gemma4_checkpoint(partial, spec, device=device, dtype=dtype)
    else:
        build = build_llava_checkpoint if isinstance(spec, TinyLlavaSpec) else build_qwen_vl_checkpoint
        build(partial, spec, device=device, dtype=dtype)
    elapsed = time.perf_counter() - start
    partial.rename(path)
    return path, elapsed


# -- memory-read floor ----------------------------------------------------------------------------


def measure_bandwidth_gbs(device: torch.device) -> float:
    """Memory bandwidth from a device-to-device copy (each copy reads and writes its bytes). Run it
    before the engine takes its KV cache out of the free memory; the buffers are returned after."""
    nbytes, reps = ((1 << 30), 20) if device.type == "cuda" else ((64 << 20), 5)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    elapsed = time.perf_counter() - start
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes * reps / elapsed / 1e9


def decode_weight_bytes(model: torch.nn.Module, batch_size: int | None = None) -> int:
    """Bytes of the parameters a decode step reads in full: decoder layers, final norm, lm_head (also
    when it is tied to the embedding). Not the vision tower or projector, nor the embedding table.
    Routed experts (a MoE layer's E experts, top-k a token) count as the experts a batch of
    `batch_size` tokens is expected to touch under uniform routing, E x (1 - (1 - k/E)^batch): the
    *active* weights (all of them when batch_size is None). Projections kept quantized count their
    stored bits (their weights, scales and zeros are buffers)."""
    from mmengine.layers.moe import FusedExperts, QuantizedFusedExperts
    from mmengine.layers.quantized_linear import QuantizedLinear

    unread = ("vision_tower.", "visual.", "multi_modal_projector.", "embed_tokens.")
    names: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    quantized = [(f"{name}.{b}", buffer) for name, module in model.named_modules()
                 if isinstance(module, (QuantizedLinear, QuantizedFusedExperts)) for b, buffer in module.named_buffers(recurse=False)]
    for name, param in [*model.named_parameters(remove_duplicate=False), *quantized]:
        names.setdefault(param.data_ptr(), []).append(name)
        sizes[param.data_ptr()] = param.numel() * param.element_size()
    for module in model.modules():
        if isinstance(module, (FusedExperts, QuantizedFusedExperts)) and batch_size is not None:
            share = 1 - (1 - module.top_k / module.num_experts) ** batch_size
            for param in (module.gate_up_proj, module.down_proj):
                sizes[param.data_ptr()] = int(sizes[param.data_ptr()] * share)
    return sum(sizes[ptr] for ptr, ns in names.items() if any(not any(u in n for u in unread) for n in ns))


def quantized_paths(model: torch.nn.Module) -> dict[str, int]:
    """How many projections keep their bits, by the GEMM they run: W4A16, FP8 W8A16, FP8 W8A8."""
    from mmengine.layers.quantized_linear import Fp8Linear, Int4Linear

    layers = list(model.modules())
    return {"w4a16": sum(isinstance(m, Int4Linear) for m in layers),
            "fp8_w8a16": sum(isinstance(m, Fp8Linear) and not m.w8a8 for m in layers),
            "fp8_w8a8": sum(isinstance(m, Fp8Linear) and m.w8a8 for m in layers)}


def kv_bytes_per_token(engine: MMEngine) -> int:
    return engine.runner.kv_block_bytes // engine.runner.block_size  # in the KV cache's dtype (fp8: 1 byte)


# -- decode ---------------------------------------------------------------------------------------


def text_prompt(tokenizer, rng: random.Random, tokens: int) -> str:
    """A random-word chat prompt of at least `tokens` tokens (a few more at most)."""
    words: list[str] = []
    prompt = ""
    while len(tokenizer(prompt).input_ids) < tokens:
        words += [rng.choice(WORDS) for _ in range(4)]
        prompt = f"USER: {' '.join(words)} ASSISTANT:"
    return prompt


class DecodeBatch:
    """`batch_size` text requests that decode together; `step()` times one engine step."""

    def __init__(self, engine: MMEngine, batch_size: int, prompt_tokens: int, max_tokens: int, seed: int) -> None:
        self.engine, self.batch_size = engine, batch_size
        rng = random.Random(seed)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.ids = [
            engine.add_request(text_prompt(engine.tokenizer, rng, prompt_tokens), sampling_params=params)
            for _ in range(batch_size)
        ]

    def steady_steps(self, count: int) -> list[tuple[float, int]]:
        """(seconds, KV tokens read) of the next `count` steady steps (every request gets a token,
        nothing is prefilled), fewer if the requests finish first. A step's time is the interval
        between consecutive step() returns: with async scheduling steps overlap, so the device is
        not synchronized between them (without it, each step() ends by waiting for its tokens)."""
        found = []
        last = None  # the first call only starts the clock: its interval would include whatever ran before
        while len(found) < count and self.engine.has_unfinished_requests():
            prefilled = self.engine.stats()["prefill_tokens_computed"]
            outputs = self.engine.step()
            now = time.perf_counter()
            steady = self.engine.stats()["prefill_tokens_computed"] == prefilled and len(outputs) == self.batch_size
            if steady and last is not None:
                found.append((now - last, sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outputs)))
            last = now
        return found

    def __enter__(self) -> DecodeBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        for request_id in self.ids:
            self.engine.abort_request(request_id)


def run_decode(engine: MMEngine, batch_size: int, args: argparse.Namespace, weight_bytes: int, kv_token_bytes: int,
               bandwidth_gbs: float) -> dict:
    with DecodeBatch(engine, batch_size, args.prompt_tokens, args.warmup_steps + args.decode_steps + 8, seed=batch_size) as batch:
        batch.steady_steps(args.warmup_steps)  # first launches of this batch shape (JIT, allocator)
        steps = batch.steady_steps(args.decode_steps)
    if not steps:
        return {"batch_size": batch_size, "steps_timed": 0}
    times_ms = sorted(1e3 * t for t, _ in steps)
    kv_tokens = statistics.mean(n for _, n in steps)
    weight_floor_ms = weight_bytes / (bandwidth_gbs * 1e9) * 1e3
    kv_floor_ms = kv_tokens * kv_token_bytes / (bandwidth_gbs * 1e9) * 1e3
    median_ms = statistics.median(times_ms)
    return {
        "batch_size": batch_size,
        "steps_timed": len(steps),
        "median_ms": median_ms,
        "min_ms": times_ms[0],
        "max_ms": times_ms[-1],
        "mean_context_tokens": kv_tokens / batch_size,
        "weight_floor_ms": weight_floor_ms,
        "kv_floor_ms": kv_floor_ms,
        "floor_ms": weight_floor_ms + kv_floor_ms,
        "median_over_weight_floor": median_ms / weight_floor_ms,
        "median_over_floor": median_ms / (weight_floor_ms + kv_floor_ms),
    }


# -- time to first token --------------------------------------------------------------------------


def ttft_ms(engine: MMEngine, prompt: str, images: list) -> tuple[float, int]:
    """(wall ms of generate(max_tokens=1), vision encoder runs it caused)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    runs = engine.stats()["encoder_runs"]
    sync(engine.device)
    start = time.perf_counter()
    engine.generate(prompt, images=images, sampling_params=params, use_tqdm=False)
    sync(engine.device)
    return 1e3 * (time.perf_counter() - start), engine.stats()["encoder_runs"] - runs


def run_ttft(engine: MMEngine, image_size: tuple[int, int], repeats: int) -> dict:
    warm = make_test_image(10_000, size=image_size)
    question, other_question = (image_question(engine, q) for q in QUESTIONS)
    for prompt in (question, question, other_question):  # every shape the three cases take, compiled
        ttft_ms(engine, prompt, [warm])
    cases: dict[str, list[tuple[float, int]]] = {"new_image": [], "same_request": [], "same_image_new_question": []}
    for r in range(repeats):
        image = make_test_image(20_000 + r, size=image_size)
        cases["new_image"].append(ttft_ms(engine, question, [image]))
        cases["same_request"].append(ttft_ms(engine, question, [image]))
        cases["same_image_new_question"].append(ttft_ms(engine, other_question, [image]))
    return {
        name: {"median_ms": statistics.median(ms for ms, _ in runs), "all_ms": [ms for ms, _ in runs],
               "encoder_runs": sum(n for _, n in runs)}
        for name, runs in cases.items()
    }


def run_transformers_ttft(model: str, prompt: str, image_size: tuple[int, int], repeats: int, device: torch.device,
                          dtype: torch.dtype) -> dict:
    """transformers' time to first token for a new picture, as its users get it: the processor call and
    `generate(max_new_tokens=1)` (the engine that measured its own TTFT must be freed first)."""
    from transformers import AutoModelForImageTextToText

    from mmengine.models.registry import load_hf_processor

    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=dtype).to(device).eval()
    processor = load_hf_processor(Path(model))

    def first_token(image) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            inputs = processor(text=[prompt], images=[image], return_tensors="pt").to(device)
            for key in ("pixel_values", "pixel_values_videos"):
                if key in inputs:
                    inputs[key] = inputs[key].to(dtype)
            hf.generate(**inputs, do_sample=False, max_new_tokens=1, min_new_tokens=1)
        sync(device)
        return 1e3 * (time.perf_counter() - start)

    first_token(make_test_image(29_999, size=image_size))  # warm-up
    all_ms = [first_token(make_test_image(30_000 + r, size=image_size)) for r in range(repeats)]
    del hf
    return {"median_ms": statistics.median(all_ms), "all_ms": all_ms}


# -- GPU-busy share -------------------------------------------------------------------------------


def busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping kernels count once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def run_gpu_busy(engine: MMEngine, batch_size: int, args: argparse.Namespace) -> dict:
    if engine.device.type != "cuda":
        return {"skipped": f"device is {engine.device.type}: nothing runs asynchronously to the host"}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    steps = args.profile_steps
    with DecodeBatch(engine, batch_size, args.prompt_tokens, args.warmup_steps + 2 * steps + 8, seed=batch_size) as batch:
        batch.steady_steps(args.warmup_steps)
        unprofiled = batch.steady_steps(steps)
        if not unprofiled:
            return {"skipped": f"no steady decode steps at batch {batch_size} (too few KV blocks?)"}
        sync(engine.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):  # each call launches one step (and reads the previous one's tokens)
                engine.step()
            sync(engine.device)
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in device_events]
    if not intervals:
        return {"skipped": "the profiler recorded no device activity"}
    busy_us = busy_union_us(intervals)
    span_us = max(end for _, end in intervals) - min(start for start, _ in intervals)
    return {
        "batch_size": batch_size,
        "steps_profiled": steps,
        "step_ms": statistics.median(1e3 * t for t, _ in unprofiled),
        "device_busy_ms_per_step": busy_us / 1e3 / steps,
        "gpu_busy_share": busy_us / span_us,  # within the profiled stretch of the device's timeline
        "device_ops_per_step": len(device_events) / steps,
    }


# -- tensor parallelism -----------------------------------------------------------------------------


def run_parallel(engine: MMEngine, model: str, origin: dict, args: argparse.Namespace, bandwidth: float) -> dict:
    """--tensor-parallel-size N: the decode step against one rank's weight-read floor (every rank reads its share of
    the weights each step, at once) and the TTFT; the GPU-busy share is the ranks' (their processes), not measured here."""
    parallel = engine.parallel
    weight_bytes = parallel.weight_bytes_per_rank[0]
    kv_token_bytes = kv_bytes_per_token(engine)
    print(f"{model} on {args.tensor_parallel_size} ranks ({engine.device}, {str(engine.dtype).removeprefix('torch.')}): each rank "
          f"holds {weight_bytes / 1e9:.3f} GB of weights + {kv_token_bytes / 1e3:.1f} KB of KV per context token; bandwidth "
          f"{bandwidth:.0f} GB/s a device ({'given' if args.bandwidth_gbs else 'measured'})")
    result: dict = {
        "model": model, "checkpoint": origin, "settings": {k: v for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "tensor_parallel_size": args.tensor_parallel_size, "enable_expert_parallel": args.enable_expert_parallel,
        "memory": {"bandwidth_gbs": bandwidth, "weight_bytes_per_rank": parallel.weight_bytes_per_rank,
                   "decode_weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token_bytes},
    }
    print(f"{'batch':>6} {'median ms':>10} {'min ms':>8} {'weight floor':>13} {'+KV floor':>10} {'x floor':>8} {'context':>8}")
    result["decode"] = []
    for batch_size in args.batch_sizes:
        row = run_decode(engine, batch_size, args, weight_bytes, kv_token_bytes, bandwidth)
        result["decode"].append(row)
        if row["steps_timed"]:
            print(f"{batch_size:>6} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f} {row['weight_floor_ms']:>13.2f} "
                  f"{row['floor_ms']:>10.2f} {row['median_over_floor']:>8.2f} {row['mean_context_tokens']:>8.0f}")
    result["ttft"] = run_ttft(engine, args.image_size, args.ttft_repeats)
    for name, case in result["ttft"].items():
        print(f"TTFT {name:<24} {case['median_ms']:8.2f} ms median  (encoder runs: {case['encoder_runs']})")
    result["gpu_busy"] = {"skipped": "tensor parallelism: the devices are the worker processes'"}
    engine.shutdown()
    write_json(args.output, result)
    return result


# -- main -----------------------------------------------------------------------------------------


def add_model_source(parser: argparse.ArgumentParser) -> None:
    """--model or --build-7b (what resolve_model reads); shared by the sibling scripts."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny model)")
    source.add_argument("--build-7b", metavar="DIR", default=None,
                        help="use the family's 7B-shaped random checkpoint in DIR, building it there if missing")


def non_negative_ints(text: str) -> list[int]:
    """Comma-separated ints >= 0 (e.g. adapter counts, where 0 means none)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 0, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(parser)
    parser.add_argument("--family", default="llava", choices=["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"],
                        help="the built-in model's family (tiny, or the published shape with --build-7b: LLaVA-1.5-7B, "
                             "Qwen2.5-VL-7B, Qwen3-VL-30B-A3B; qwen2_vl and the Qwen3.5 ones: tiny only)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    parser.add_argument("--batch-sizes", type=_positive_ints, default="1,16,64,256", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of the decode requests")
    parser.add_argument("--warmup-steps", type=int, default=3, help="steady decode steps run before timing")
    parser.add_argument("--decode-steps", type=int, default=20, help="steady decode steps timed per batch size")
    parser.add_argument("--ttft-repeats", type=int, default=5)
    parser.add_argument("--image-size", type=_image_size, default="640x480", help="WIDTHxHEIGHT of the TTFT images")
    parser.add_argument("--profile-batch-size", type=int, default=64, help="decode batch for the GPU-busy share")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth (default: measured)")
    parser.add_argument("--transformers-ttft", action="store_true",
                        help="also time transformers' processor + generate(max_new_tokens=1) on new pictures, after the engine is freed")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks the decoder is split over (worker processes, one GPU each; docs/parallelism.md)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE decoders at --tensor-parallel-size N: whole experts per rank (E / N each) instead of "
                             "every expert split on its intermediate size")
    parser.add_argument("--output", default="benchmarks/results/latency.json")
    return parser.parse_args(argv)


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return values


def _image_size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    if not (width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 640x480, got {text!r}")
    return int(width), int(height)


def resolve_model(args: argparse.Namespace) -> tuple[str, dict]:
    """The checkpoint `args` name (--model, or --build-7b built if missing, or the built-in tiny
    model of --family, LLaVA without one) and how it came about. Shared by the sibling scripts."""
    if args.model:
        return args.model, {}
    llava = getattr(args, "family", "llava") == "llava"
    if args.build_7b:
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        spec, name = {"llava": (LLAVA_1_5_7B_SPEC, "LLAVA_1_5_7B_SPEC"),
                      "qwen3_vl_moe": (QWEN3_VL_30B_A3B_SPEC, "QWEN3_VL_30B_A3B_SPEC")}.get(
            getattr(args, "family", "llava"), (QWEN2_5_VL_7B_SPEC, "QWEN2_5_VL_7B_SPEC"))
        path, seconds = ensure_checkpoint(Path(args.build_7b), spec, device, "bfloat16")
        return str(path), {"build_s": seconds, "spec": name}
    if llava:
        return str(tiny_llava_path(TinyLlavaSpec())), {"spec": "TinyLlavaSpec()"}
    return str(tiny_qwen_vl_path(tiny_spec(args.family))), {"spec": f"tiny_spec({args.family!r})"}


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model, origin = resolve_model(args)
    bandwidth = args.bandwidth_gbs or measure_bandwidth_gbs(EngineConfig(model=model, device=args.device).resolve_device())
    # tensor parallelism: every rank replays its CUDA graphs as TP 1 does (docs/parallelism.md)
    parallel = {"tensor_parallel_size": args.tensor_parallel_size} if args.tensor_parallel_size > 1 else {}
    if args.enable_expert_parallel:
        parallel["enable_expert_parallel"] = True  # (refused by name without --tensor-parallel-size > 1)
    engine = MMEngine(
        model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch_sizes + [args.profile_batch_size]),
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype, **parallel,
    )
    device = engine.device
    if engine.parallel is not None:  # the model is in the worker processes: the per-GPU floor is one rank's weights
        return run_parallel(engine, model, origin, args, bandwidth)
    weight_bytes = decode_weight_bytes(engine.runner.model)
    kv_token_bytes = kv_bytes_per_token(engine)
    print(f"{model} on {device} in {str(engine.dtype).removeprefix('torch.')}: decode reads {weight_bytes / 1e9:.3f} GB "
          f"of weights + {kv_token_bytes / 1e3:.1f} KB of KV per context token; bandwidth {bandwidth:.0f} GB/s "
          f"({'given' if args.bandwidth_gbs else 'measured'})")

    result: dict = {
        "model": model,
        "checkpoint": origin,
        "settings": {k: v for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "device": str(device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "memory": {
            "bandwidth_gbs": bandwidth,
            "bandwidth_source": "--bandwidth-gbs" if args.bandwidth_gbs else "measured (device-to-device copy)",
            "weight_bytes_total": sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()),
            "decode_weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_token_bytes,
        },
        "quantized_paths": quantized_paths(engine.runner.model),
    }
    if any(result["quantized_paths"].values()):
        print("projections kept quantized, by GEMM: " + ", ".join(f"{k} {v}" for k, v in result["quantized_paths"].items()))

    print(f"{'batch':>6} {'median ms':>10} {'min ms':>8} {'weight floor':>13} {'+KV floor':>10} {'x floor':>8} {'context':>8}")
    result["decode"] = []
    for batch_size in args.batch_sizes:
        row = run_decode(engine, batch_size, args, decode_weight_bytes(engine.runner.model, batch_size), kv_token_bytes, bandwidth)
        result["decode"].append(row)
        if row["steps_timed"]:
            print(f"{batch_size:>6} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f} {row['weight_floor_ms']:>13.2f} "
                  f"{row['floor_ms']:>10.2f} {row['median_over_floor']:>8.2f} {row['mean_context_tokens']:>8.0f}")
        else:
            print(f"{batch_size:>6}  no steady decode step (too few KV blocks for this batch?)")

    result["ttft"] = run_ttft(engine, args.image_size, args.ttft_repeats)
    for name, case in result["ttft"].items():
        print(f"TTFT {name:<24} {case['median_ms']:8.2f} ms median  (encoder runs: {case['encoder_runs']})")

    profile_batch = args.profile_batch_size
    result["gpu_busy"] = run_gpu_busy(engine, profile_batch, args)
    busy = result["gpu_busy"]
    if "skipped" in busy:
        print(f"GPU-busy share: skipped ({busy['skipped']})")
    else:
        print(f"GPU-busy share at batch {profile_batch}: {busy['gpu_busy_share']:.0%} "
              f"({busy['device_busy_ms_per_step']:.2f} of {busy['step_ms']:.2f} ms, {busy['device_ops_per_step']:.0f} device ops per step)")

    if args.transformers_ttft:
        prompt, device, dtype = image_question(engine, QUESTIONS[0]), engine.device, engine.dtype
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        baseline = run_transformers_ttft(model, prompt, args.image_size, args.ttft_repeats, device, dtype)
        result["ttft"]["transformers_new_image"] = baseline
        result["ttft"]["new_image_over_transformers"] = result["ttft"]["new_image"]["median_ms"] / baseline["median_ms"]
        print(f"TTFT {'transformers, new image':<24} {baseline['median_ms']:8.2f} ms median  "
              f"(mmengine's new image: {result['ttft']['new_image_over_transformers']:.2f}x)")

    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
