"""Offline throughput: mmengine vs transformers' generate() on the same prompts, in one run.

    python benchmarks/throughput.py                       # built-in tiny model, CPU-friendly
    python benchmarks/throughput.py --model PATH --num-requests 200 --output-len 128

Prints requests/s and tokens/s for both and their ratio, and writes JSON.
transformers runs one request at a time (batch size 1, its plain use for VLMs with
differently sized prompts); mmengine runs the whole batch with continuous batching.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from mmengine import MMEngine, SamplingParams
from mmengine.testing import TinyLlavaSpec, make_test_image, tiny_llava_path

WORDS = "the a picture of small large red blue green cat dog boat house tree river sky cloud road".split()


def make_workload(num_requests: int, unique_images: int, image_fraction: float, prompt_words: int, seed: int):
    rng = random.Random(seed)
    images = [make_test_image(s, size=(rng.randint(32, 96), rng.randint(32, 96))) for s in range(unique_images)]
    prompts, image_lists = [], []
    for _ in range(num_requests):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(prompt_words // 2, prompt_words)))
        if rng.random() < image_fraction:
            prompts.append(f"USER: <image>\n{words} ASSISTANT:")
            image_lists.append([rng.choice(images)])
        else:
            prompts.append(f"USER: {words} ASSISTANT:")
            image_lists.append([])
    return prompts, image_lists


def run_mmengine(model: str, prompts, image_lists, output_len: int, engine_kwargs: dict) -> dict:
    engine = MMEngine(model, **engine_kwargs)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], images=image_lists[:2], sampling_params=params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, images=image_lists, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return _summary(elapsed, len(outputs), sum(len(o.prompt_token_ids) for o in outputs), sum(len(o.token_ids) for o in outputs)) | {
        "stats": engine.stats()
    }


def run_transformers(model: str, prompts, image_lists, output_len: int, device: str, dtype: torch.dtype) -> dict:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(model, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(model)
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len)
    prompt_tokens = generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt, images in zip(prompts, image_lists):
            inputs = processor(text=prompt, images=images or None, return_tensors="pt").to(device)
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
            out = hf.generate(**inputs, **kwargs)
            prompt_tokens += inputs["input_ids"].shape[1]
            generated += out.shape[1] - inputs["input_ids"].shape[1]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return _summary(time.perf_counter() - start, len(prompts), prompt_tokens, generated)


def _summary(elapsed: float, num_requests: int, prompt_tokens: int, output_tokens: int) -> dict:
    return {
        "elapsed_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--unique-images", type=int, default=8)
    parser.add_argument("--image-fraction", type=float, default=0.75)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run transformers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/throughput.json")
    args = parser.parse_args()

    model = args.model or str(tiny_llava_path(TinyLlavaSpec()))
    prompts, image_lists = make_workload(args.num_requests, args.unique_images, args.image_fraction, args.prompt_words, args.seed)
    engine_kwargs = dict(
        device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    ours = run_mmengine(model, prompts, image_lists, args.output_len, engine_kwargs)
    result = {
        "model": model,
        "workload": vars(args),
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "mmengine": ours,
    }
    print(f"mmengine:     {ours['requests_per_s']:8.2f} req/s  {ours['output_tokens_per_s']:9.1f} output tok/s  ({ours['elapsed_s']:.2f}s)")
    if not args.skip_baseline:
        engine = MMEngine(model, **engine_kwargs)
        device, dtype = str(engine.device), engine.dtype
        del engine
        base = run_transformers(model, prompts, image_lists, args.output_len, device, dtype)
        result["transformers"] = base
        result["speedup_requests_per_s"] = ours["requests_per_s"] / base["requests_per_s"]
        print(f"transformers: {base['requests_per_s']:8.2f} req/s  {base['output_tokens_per_s']:9.1f} output tok/s  ({base['elapsed_s']:.2f}s)")
        print(f"speedup (mmengine / transformers): {result['speedup_requests_per_s']:.2f}x")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
