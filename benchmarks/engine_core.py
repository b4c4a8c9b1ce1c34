"""AsyncMMEngine's engine core in a thread vs in a process of its own (engine_core="process"), online.

C concurrent clients send N one-image requests (each a new JPEG, so every picture is decoded,
preprocessed and encoded) through AsyncMMEngine, streaming each answer; the same requests also run
offline through MMEngine.generate(). Reported per core: requests/s, output tokens/s, mean and p90 time to
first token, and online / offline (requests/s through AsyncMMEngine over generate()'s). Writes JSON.

    python benchmarks/engine_core.py                        # tiny built-in LLaVA on CPU
    python benchmarks/engine_core.py --model DIR --device cuda --num-requests 512 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import statistics
import time
from pathlib import Path

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.testing import make_test_image, tiny_llava_path

PROMPT = "USER: <image>\nWhat is shown in this picture? ASSISTANT:"


def _size(text: str) -> tuple[int, int]:
    width, height = text.lower().split("x")
    return int(width), int(height)


def pictures(count: int, size: tuple[int, int], seed: int) -> list[bytes]:
    out = []
    for i in range(count):
        buffer = io.BytesIO()
        make_test_image(seed + i, size=size).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


async def online(async_engine: AsyncMMEngine, images: list[bytes], params: SamplingParams, concurrency: int) -> dict:
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for image in images:
        queue.put_nowait(image)
    ttfts: list[float] = []
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while not queue.empty():
            image = queue.get_nowait()
            sent = time.perf_counter()
            first = None
            async for delta in async_engine.generate(PROMPT, [image], params):
                if first is None and delta.token_ids:
                    first = time.perf_counter() - sent
                tokens += len(delta.token_ids)
            ttfts.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    ttfts.sort()
    return {"seconds": elapsed, "requests_per_s": len(images) / elapsed, "output_tokens_per_s": tokens / elapsed,
            "ttft_mean_ms": 1000 * statistics.fmean(ttfts), "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))]}


async def run_core(model: str, core: str, options: dict, images: list[bytes], warm: list[bytes], params: SamplingParams,
                   concurrency: int, preprocess_workers: int) -> dict:
    started = time.perf_counter()
    async_engine = AsyncMMEngine.from_model(model, engine_core=core, num_preprocess_workers=preprocess_workers, **options)
    try:
        startup = time.perf_counter() - started
        await online(async_engine, warm, params, concurrency)  # warm-up: first steps, allocator, threads
        result = await online(async_engine, images, params, concurrency)
        stats = async_engine.engine.stats()
        result.update(startup_s=startup, encoder_runs=stats["encoder_runs"], images_decoded=stats["images_decoded"])
        return result
    finally:
        await async_engine.shutdown()
        if core == "thread":
            async_engine.engine.close()


def offline(model: str, options: dict, images: list[bytes], warm: list[bytes], params: SamplingParams) -> dict:
    engine = MMEngine(model, **options)
    engine.generate([PROMPT] * len(warm), images=[[image] for image in warm], sampling_params=params, use_tqdm=False)
    start = time.perf_counter()
    outputs = engine.generate([PROMPT] * len(images), images=[[image] for image in images], sampling_params=params,
                              use_tqdm=False)
    elapsed = time.perf_counter() - start
    engine.close()
    return {"seconds": elapsed, "requests_per_s": len(images) / elapsed,
            "output_tokens_per_s": sum(len(o.token_ids) for o in outputs) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny LLaVA)")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--image-size", type=_size, default="640x480")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--preprocess-workers", type=int, default=2, help="AsyncMMEngine's preprocessing threads")
    parser.add_argument("--mm-processor-workers", type=int, default=0, help="preprocessing worker processes")
    parser.add_argument("--cores", default="thread,process", help="which cores to run, comma-separated")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/engine_core.json")
    args = parser.parse_args()

    model = args.model or str(tiny_llava_path())
    options = {"device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
               "mm_processor_workers": args.mm_processor_workers}
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm = pictures(8, args.image_size, args.seed + 1_000_000)
    results: dict = {"config": {**vars(args), "model": model, "image_size": list(args.image_size),
                                "cpus": os.cpu_count(), "platform": platform.platform()}}
    if not args.skip_offline:
        results["offline"] = offline(model, options, pictures(args.num_requests, args.image_size, args.seed), warm, params)
        print(f"offline generate(): {results['offline']['requests_per_s']:.2f} req/s")
    for core in args.cores.split(","):
        # new pictures for every run: nothing comes from a processor or encoder cache of an earlier one
        images = pictures(args.num_requests, args.image_size, args.seed + 10_000 * (1 + len(results)))
        result = asyncio.run(run_core(model, core, options, images, warm, params, args.concurrency,
                                      args.preprocess_workers))
        if "offline" in results:
            result["online_over_offline"] = result["requests_per_s"] / results["offline"]["requests_per_s"]
        results[core] = result
        ratio = f", online/offline {result['online_over_offline']:.2f}" if "online_over_offline" in result else ""
        print(f"{core:>7} core: {result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.1f} tok/s, "
              f"TTFT mean {result['ttft_mean_ms']:.0f} ms p90 {result['ttft_p90_ms']:.0f} ms{ratio} "
              f"(start-up {result['startup_s']:.1f} s)")
    if "thread" in results and "process" in results:
        results["process_over_thread"] = results["process"]["requests_per_s"] / results["thread"]["requests_per_s"]
        print(f"process / thread: {results['process_over_thread']:.2f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
