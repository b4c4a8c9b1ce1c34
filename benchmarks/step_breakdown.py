"""Where a step's time goes: the host's phases (scheduling, input preparation, encoding, kernel
launches, booking, token resolution, detokenization) and its wait for the device, per step, for
steady decode batches and for an image workload, with and without async scheduling.

    python benchmarks/step_breakdown.py                                 # built-in tiny model, CPU-friendly
    python benchmarks/step_breakdown.py --build-7b /tmp/llava-1.5-7b --batch-sizes 1,64,256 \\
        --decode-steps 30 --image-requests 512 --unique-images 64 --image-size-max 640 --output-len 128

Each phase is the host time spent inside one of the engine's own methods, wrapped with a timer (no
device sync added). "wait" is LaunchedStep.result(), the step's one read of its tokens: time the
host had nothing to do but wait for the device. Synchronous steps cost host + device; with async
scheduling the host phases run while the device computes the step before, so a step costs about
the larger of the two, and "wait" is what the device took beyond the host.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import WORDS, resolve_model, sync, text_prompt, write_json  # noqa: E402  (a sibling script)

from mmengine import MMEngine, SamplingParams  # noqa: E402
from mmengine.testing import make_test_image  # noqa: E402

PHASES = ("preprocess", "schedule", "encode", "prepare", "launch_other", "wait", "update", "book", "resolve", "detokenize")


class PhaseTimers:
    """Accumulated host seconds per phase, from timers wrapped around an engine's methods."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, method: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def instrument(self, engine: MMEngine) -> None:
        scheduler, runner = engine.scheduler, engine.runner
        engine.input_processor.process = self.wrap("preprocess", engine.input_processor.process)
        scheduler.schedule = self.wrap("schedule", scheduler.schedule)
        scheduler.update_from_output = self.wrap("update", scheduler.update_from_output)
        scheduler.book_step = self.wrap("book", scheduler.book_step)
        scheduler.resolve_tokens = self.wrap("resolve", scheduler.resolve_tokens)
        runner._run_encoder = self.wrap("encode", runner._run_encoder)
        runner.inputs.prepare = self.wrap("prepare", runner.inputs.prepare)
        engine.steps.after_token = self.wrap("detokenize", engine.steps.after_token)
        launch = self.wrap("launch", runner.launch)

        def launch_and_time_the_wait(*args, **kwargs):
            step = launch(*args, **kwargs)
            if step.sampled_ids:  # (the shared empty result stays untouched)
                step.result = self.wrap("wait", step.result)
            return step

        runner.launch = launch_and_time_the_wait

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def per_step_ms(self, steps: int) -> dict[str, float]:
        ms = {name: 1e3 * self.seconds.get(name, 0.0) / steps for name in PHASES if name != "launch_other"}
        # the launch's own work: kernel launches (and an eager forward's waits), not its encode or prepare
        ms["launch_other"] = 1e3 * (self.seconds.get("launch", 0.0) - self.seconds.get("encode", 0.0)
                                    - self.seconds.get("prepare", 0.0)) / steps
        return {name: round(ms[name], 3) for name in PHASES}


def run_decode(engine: MMEngine, timers: PhaseTimers, batch_size: int, args: argparse.Namespace) -> dict:
    """Steady decode steps of `batch_size` text requests (prefill finished, nothing in flight from it)."""
    rng = random.Random(batch_size)
    params = SamplingParams(max_tokens=args.decode_steps + 64, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(text_prompt(engine.tokenizer, rng, args.prompt_tokens), sampling_params=params)
           for _ in range(batch_size)]
    try:
        quiet = 0
        while quiet < 3:
            before = engine.stats()["prefill_tokens_computed"]
            engine.step()
            quiet = quiet + 1 if engine.stats()["prefill_tokens_computed"] == before else 0
        sync(engine.device)
        timers.reset()
        start = time.perf_counter()
        for _ in range(args.decode_steps):
            engine.step()
        sync(engine.device)
        elapsed = time.perf_counter() - start
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    return {"batch_size": batch_size, "steps": args.decode_steps, "step_ms": round(1e3 * elapsed / args.decode_steps, 3),
            "phases_ms_per_step": timers.per_step_ms(args.decode_steps)}


def image_workload(args: argparse.Namespace) -> tuple[list[str], list[list]]:
    rng = random.Random(0)
    sizes = [(rng.randint(args.image_size_max // 2, args.image_size_max), rng.randint(args.image_size_max // 2, args.image_size_max))
             for _ in range(args.unique_images)]
    images = [make_test_image(seed, size=size) for seed, size in enumerate(sizes)]
    prompts, image_lists = [], []
    for _ in range(args.image_requests):
        text = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        prompts.append(f"USER: <image>\n{text} ASSISTANT:")
        image_lists.append([rng.choice(images)])
    return prompts, image_lists


def run_images(engine: MMEngine, timers: PhaseTimers, args: argparse.Namespace) -> dict:
    prompts, image_lists = image_workload(args)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    engine.reset_encoder_cache()
    before = engine.stats()
    timers.reset()
    start = time.perf_counter()
    outputs = engine.generate(prompts, images=image_lists, sampling_params=params, use_tqdm=False)
    sync(engine.device)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    counts = {k: after[k] - before[k] for k in ("steps", "prefill_tokens_computed", "tokens_computed", "encoder_runs",
                                                 "cascade_steps")}
    return {"requests": len(outputs), "elapsed_s": round(elapsed, 3), "requests_per_s": round(len(outputs) / elapsed, 2),
            "output_tokens": sum(len(o.token_ids) for o in outputs), **counts,
            "phases_ms_per_step": timers.per_step_ms(max(counts["steps"], 1)),
            "step_ms": round(1e3 * elapsed / max(counts["steps"], 1), 3)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny model)")
    source.add_argument("--build-7b", metavar="DIR", default=None, help="build (if missing) and use a LLaVA-1.5-7B-shaped checkpoint")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--async-scheduling", default="off,on", help="comma-separated modes to compare")
    parser.add_argument("--cascade-attention", default="auto")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of the decode requests")
    parser.add_argument("--decode-steps", type=int, default=5)
    parser.add_argument("--image-requests", type=int, default=16, help="0 skips the image workload")
    parser.add_argument("--unique-images", type=int, default=4)
    parser.add_argument("--image-size-max", type=int, default=64, help="pictures are up to this many pixels a side")
    parser.add_argument("--prompt-words", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engine's batch limit, which the image workload runs at (default: the largest batch size)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--output", default="benchmarks/results/step_breakdown.json")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(v) for v in args.batch_sizes.split(",")]
    if args.max_num_seqs is not None and args.max_num_seqs < max(args.batch_sizes):
        parser.error(f"--max-num-seqs {args.max_num_seqs} is below the largest batch size {max(args.batch_sizes)}")
    args.async_scheduling = args.async_scheduling.split(",")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model, origin = resolve_model(args)
    result: dict = {"model": model, "checkpoint": origin, "settings": vars(args),
                    "machine": {"platform": platform.platform(), "torch": torch.__version__,
                                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
                    "modes": {}}
    print(f"{'scenario':<16} {'async':>5} {'step ms':>8} " + " ".join(f"{p[:10]:>10}" for p in PHASES))
    for mode in args.async_scheduling:
        engine = MMEngine(model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs or max(args.batch_sizes),
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization, async_scheduling=mode,
                          cascade_attention=args.cascade_attention)
        engine.generate("USER: warm up ASSISTANT:", sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
        timers = PhaseTimers()
        timers.instrument(engine)
        rows: dict = {f"decode bs {bs}": run_decode(engine, timers, bs, args) for bs in args.batch_sizes}
        if args.image_requests:
            rows["images"] = run_images(engine, timers, args)
        result["modes"][mode] = rows
        for name, row in rows.items():
            print(f"{name:<16} {mode:>5} {row['step_ms']:>8.2f} " + " ".join(f"{row['phases_ms_per_step'][p]:>10.3f}" for p in PHASES))
        if "images" in rows:
            print(f"{'':<16} {mode:>5} images: {rows['images']['requests_per_s']} req/s, {rows['images']['steps']} steps")
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
