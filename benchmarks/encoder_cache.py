"""The encoder cache in the four situations users ask about, with transformers as the baseline.

  identical     the same prompt and image N times (offline batches with duplicates)
  same-image    one image, N different questions about it
  partial       a shared system prompt and image, then different follow-ups (hits end past the image)
  multi-turn    a chat growing turn by turn, each turn resending every earlier image

For each: vision-encoder runs per unique image, prefix-cache hit rate, and throughput, next to
transformers' generate() (which encodes every image of every prompt, every time). Writes JSON.

    python benchmarks/encoder_cache.py                     # built-in tiny model
    python benchmarks/encoder_cache.py --model PATH --num-requests 64 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from mmengine import MMEngine, SamplingParams
from mmengine.testing import make_test_image, tiny_llava_path

Workload = list[tuple[str, list]]  # (prompt, images), submitted in waves (each wave after the previous finished)


def scenarios(n: int) -> dict[str, list[Workload]]:
    images = [make_test_image(seed, size=(64, 48)) for seed in range(8)]
    system = "SYSTEM: You are an assistant that answers questions about pictures precisely and briefly."
    turns: list[Workload] = []
    history, shown = "", []
    for turn in range(min(n, 6)):
        shown.append(images[turn])
        history += f" USER: <image>\nWhat changed in picture {turn}? ASSISTANT:"
        turns.append([(system + history, list(shown))])
        history += " It is a picture."
    return {
        "identical": [[("USER: <image>\nDescribe this picture. ASSISTANT:", [images[0]])] * n],
        "same-image": [[(f"USER: <image>\nQuestion {i}: what do you see? ASSISTANT:", [images[1]]) for i in range(n)]],
        "partial": [
            [(f"{system} USER: <image>\nDescribe it.", [images[2]])],
            [(f"{system} USER: <image>\nDescribe it. Then answer follow-up {i}. ASSISTANT:", [images[2]]) for i in range(n)],
        ],
        "multi-turn": turns,
    }


def run_mmengine(model: str, waves: list[Workload], params: SamplingParams, engine_kwargs: dict) -> dict:
    engine = MMEngine(model, **engine_kwargs)
    start = time.perf_counter()
    for wave in waves:
        engine.generate([p for p, _ in wave], images=[i for _, i in wave], sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {"elapsed_s": elapsed, "encoder_runs": stats["encoder_runs"],
            "hit_rate": stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]), "stats": stats}


def run_transformers(model: str, waves: list[Workload], output_len: int, device: str, dtype: torch.dtype) -> dict:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(model, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(model)
    encoder_runs = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for wave in waves:
            for prompt, images in wave:
                inputs = processor(text=prompt, images=images, return_tensors="pt").to(device)
                inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
                hf.generate(**inputs, do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len)
                encoder_runs += len(images)
    return {"elapsed_s": time.perf_counter() - start, "encoder_runs": encoder_runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--output", default="benchmarks/results/encoder_cache.json")
    args = parser.parse_args()

    model = args.model or str(tiny_llava_path())
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine_kwargs = {"device": args.device, "dtype": args.dtype, "max_model_len": 1024}
    probe = MMEngine(model, num_kv_blocks=1, **engine_kwargs)
    device, dtype = str(probe.device), probe.dtype
    del probe
    result = {"model": model, "args": vars(args), "machine": {"platform": platform.platform(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}}
    for name, waves in scenarios(args.num_requests).items():
        num_requests = sum(len(w) for w in waves)
        unique = len({id(img) for wave in waves for _, imgs in wave for img in imgs})
        ours = run_mmengine(model, waves, params, engine_kwargs)
        row = {"requests": num_requests, "unique_images": unique, "mmengine": ours,
               "mmengine_encoder_runs_per_unique_image": ours["encoder_runs"] / unique}
        line = (f"[{name:10s}] {num_requests:3d} requests, {unique} unique images | mmengine: "
                f"{row['mmengine_encoder_runs_per_unique_image']:.2f} encodes/image, hit rate {ours['hit_rate']:6.1%}, "
                f"{num_requests / ours['elapsed_s']:7.2f} req/s")
        if not args.skip_baseline:
            base = run_transformers(model, waves, args.output_len, device, dtype)
            row["transformers"] = base
            row["speedup"] = base["elapsed_s"] / ours["elapsed_s"]
            line += (f" | transformers: {base['encoder_runs'] / unique:.2f} encodes/image, "
                     f"{num_requests / base['elapsed_s']:7.2f} req/s | {row['speedup']:.1f}x")
        result[name] = row
        print(line)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
