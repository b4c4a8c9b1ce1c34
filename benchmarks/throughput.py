"""Offline throughput: mmengine vs transformers' generate() on the same prompts, in one run.

    python benchmarks/throughput.py                       # built-in tiny model, CPU-friendly
    python benchmarks/throughput.py --model PATH --num-requests 200 --output-len 128
    python benchmarks/throughput.py --build-7b DIR --num-requests 512 --unique-images 64 \
        --image-fraction 1 --image-size-max 640 --prompt-words 40 --prompt-words-min 40 --output-len 128 \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 4096 \
        --baseline-batch-size 32 --baseline-requests 64     # the 512-request image workload on a GPU

Prints requests/s and tokens/s for both and their ratio, and writes JSON. mmengine runs the whole
batch with continuous batching. transformers runs `--baseline-batch-size` prompts per generate()
call (left padding; 1, the default, is its plain use for VLMs with differently sized prompts),
on the first `--baseline-requests` prompts: it is slow, and its rate does not depend on how many
batches it runs, so a prefix of the workload measures it.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import WORDS, resolve_model, sync, write_json  # noqa: E402  (a sibling script)

from mmengine import MMEngine, SamplingParams  # noqa: E402
from mmengine.testing import make_test_image  # noqa: E402

COUNTED = ("steps", "prefill_tokens_computed", "encoder_runs", "encoder_cache_hits", "cascade_steps", "num_preemptions")


def make_workload(args: argparse.Namespace) -> tuple[list[str], list[list]]:
    """`num_requests` prompts of prompt_words_min..prompt_words random words; a share `image_fraction`
    of them ask about one of `unique_images` pictures (sides between half and all of image_size_max)."""
    rng = random.Random(args.seed)
    low = args.image_size_max // 2
    images = [make_test_image(s, size=(rng.randint(low, args.image_size_max), rng.randint(low, args.image_size_max)))
              for s in range(args.unique_images)]
    fewest = args.prompt_words // 2 if args.prompt_words_min is None else args.prompt_words_min
    prompts, image_lists = [], []
    for _ in range(args.num_requests):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(fewest, args.prompt_words)))
        if images and rng.random() < args.image_fraction:
            prompts.append(f"USER: <image>\n{words} ASSISTANT:")
            image_lists.append([rng.choice(images)])
        else:
            prompts.append(f"USER: {words} ASSISTANT:")
            image_lists.append([])
    return prompts, image_lists


def run_mmengine(model: str, prompts, image_lists, output_len: int, engine_kwargs: dict) -> tuple[dict, MMEngine]:
    engine = MMEngine(model, **engine_kwargs)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], images=image_lists[:2], sampling_params=params, use_tqdm=False)  # warm-up
    engine.reset_prefix_cache()
    engine.reset_encoder_cache()
    before = engine.stats()
    start = time.perf_counter()
    outputs = engine.generate(prompts, images=image_lists, sampling_params=params, use_tqdm=False)
    sync(engine.device)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    summary = _summary(elapsed, len(outputs), sum(len(o.prompt_token_ids) for o in outputs),
                       sum(len(o.token_ids) for o in outputs))
    return summary | {"counts": {k: after[k] - before[k] for k in COUNTED}}, engine


def run_transformers(model: str, prompts, image_lists, output_len: int, device: str, dtype: torch.dtype,
                     batch_size: int) -> dict:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(model, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(model)
    processor.tokenizer.padding_side = "left"  # generate() continues every row from the same column
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len)

    def batch_inputs(start: int, stop: int):
        images = [image for images in image_lists[start:stop] for image in images]
        inputs = processor(text=prompts[start:stop], images=images or None, padding=True, return_tensors="pt").to(device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        return inputs

    with torch.inference_mode():  # warm-up: the first generate() call pays one-time costs
        hf.generate(**batch_inputs(0, min(batch_size, len(prompts))), **dict(kwargs, max_new_tokens=2, min_new_tokens=2))
    sync(torch.device(device))
    prompt_tokens = generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            inputs = batch_inputs(first, first + batch_size)
            out = hf.generate(**inputs, **kwargs)
            prompt_tokens += int(inputs["attention_mask"].sum())
            generated += (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    sync(torch.device(device))
    return _summary(time.perf_counter() - start, len(prompts), prompt_tokens, generated) | {"batch_size": batch_size}


def _summary(elapsed: float, num_requests: int, prompt_tokens: int, output_tokens: int) -> dict:
    return {
        "requests": num_requests,
        "elapsed_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny model)")
    source.add_argument("--build-7b", metavar="DIR", default=None, help="build (if missing) and use a LLaVA-1.5-7B-shaped checkpoint")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=24, help="the most words in a prompt")
    parser.add_argument("--prompt-words-min", type=int, default=None, help="the fewest (default: half of --prompt-words)")
    parser.add_argument("--unique-images", type=int, default=8)
    parser.add_argument("--image-fraction", type=float, default=0.75)
    parser.add_argument("--image-size-max", type=int, default=96, help="pictures are up to this many pixels a side")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run transformers")
    parser.add_argument("--baseline-batch-size", type=int, default=1, help="prompts per transformers generate() call")
    parser.add_argument("--baseline-requests", type=int, default=None, help="transformers runs this many first prompts (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/throughput.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model, origin = resolve_model(args)
    prompts, image_lists = make_workload(args)
    engine_kwargs = dict(
        device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
    )
    ours, engine = run_mmengine(model, prompts, image_lists, args.output_len, engine_kwargs)
    result = {
        "model": model,
        "checkpoint": origin,
        "workload": vars(args),
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "mmengine": ours,
    }
    print(f"mmengine:     {ours['requests_per_s']:8.2f} req/s  {ours['output_tokens_per_s']:9.1f} output tok/s  ({ours['elapsed_s']:.2f}s)")
    if not args.skip_baseline:
        device, dtype = str(engine.device), engine.dtype
        del engine  # frees its KV cache before transformers loads its own copy of the weights
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        count = args.baseline_requests or len(prompts)
        base = run_transformers(model, prompts[:count], image_lists[:count], args.output_len, device, dtype,
                                args.baseline_batch_size)
        result["transformers"] = base
        result["speedup_requests_per_s"] = ours["requests_per_s"] / base["requests_per_s"]
        print(f"transformers: {base['requests_per_s']:8.2f} req/s  {base['output_tokens_per_s']:9.1f} output tok/s  "
              f"({base['elapsed_s']:.2f}s, {count} requests, batch size {args.baseline_batch_size})")
        print(f"speedup (mmengine / transformers): {result['speedup_requests_per_s']:.2f}x")
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
