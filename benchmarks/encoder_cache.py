"""The encoder cache in the four situations users ask about, with transformers as the baseline.

  identical     the same prompt and image N times (offline batches with duplicates)
  same-image    one image, N different questions about it
  partial       a shared system prompt and image, then different follow-ups (hits end past the image)
  multi-turn    a chat growing turn by turn, each turn resending every earlier image

For each: vision-encoder runs per unique image, prefix-cache hit rate, and throughput, next to
transformers' generate() (which encodes every image of every prompt, every time). Writes JSON.

  video         N questions about each of K clips, shuffled, on a Qwen-VL checkpoint: encoder
                runs (one per temporal patch) against transformers', throughput, and the time to first
                token of a second question about a clip against the first

    python benchmarks/encoder_cache.py                     # built-in tiny model
    python benchmarks/encoder_cache.py --model PATH --num-requests 64 --output-len 32
    python benchmarks/encoder_cache.py --scenarios video --video-model PATH --clip-seconds 30 --clip-size 448x448
    # on a GPU, the published shapes built in place (once; random weights, bf16):
    python benchmarks/encoder_cache.py --scenarios video --device cuda --video-model /tmp/qwen2.5-vl-7b \
        --build-video-spec qwen2_5_vl_7b --clip-seconds 30 --clip-size 448x448
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from mmengine import MMEngine, SamplingParams
from mmengine.multimodal.video import Video
from mmengine.testing import (
    QWEN2_5_VL_7B_SPEC,
    QWEN3_VL_8B_SPEC,
    TinyQwenVLSpec,
    make_test_image,
    tiny_llava_path,
    tiny_qwen_vl_path,
)
from mmengine.testing.video import hf_video_inputs, make_test_clip

VIDEO_MARKER = "<|vision_start|><|video_pad|><|vision_end|>"

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


def _video_prompt(question: str) -> str:
    return f"<|im_start|>user\n{VIDEO_MARKER}{question}<|im_end|>\n<|im_start|>assistant\n"


VIDEO_SPECS = {"qwen2_5_vl_7b": QWEN2_5_VL_7B_SPEC, "qwen3_vl_8b": QWEN3_VL_8B_SPEC}


def run_video(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    """N questions about each of K clips, shuffled; then, on a fresh engine, the time to first token of
    a first and a second question about one clip."""
    model = args.video_model or str(tiny_qwen_vl_path(TinyQwenVLSpec(family="qwen2_5_vl")))
    if args.build_video_spec:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from latency import ensure_checkpoint  # a sibling script

        device = "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
        ensure_checkpoint(Path(model), VIDEO_SPECS[args.build_video_spec], device, "bfloat16")
    height, width = (int(x) for x in args.clip_size.split("x"))
    frames = int(args.clip_seconds * args.clip_fps)
    clips = [Video(make_test_clip(frames, height, width, seed=k), frame_rate=args.clip_fps) for k in range(args.num_clips)]
    jobs = [(_video_prompt(f"Question {q} about this clip: what happens at second {q}?"), k)
            for k in range(args.num_clips) for q in range(args.num_requests)]
    random.Random(0).shuffle(jobs)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    kwargs = engine_kwargs | {"max_model_len": args.video_max_model_len, "limit_mm_per_prompt": {"video": 1}}
    engine = MMEngine(model, **kwargs)
    patches = len(engine.input_processor.process(jobs[0][0], None, params, videos=[clips[0]]).mm_items)
    start = time.perf_counter()
    engine.generate([p for p, _ in jobs], videos=[[clips[k]] for _, k in jobs], sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    row = {"model": model, "clips": args.num_clips, "frames_per_clip": frames, "patches_per_clip": patches,
           "requests": len(jobs), "mmengine": {"elapsed_s": elapsed, "encoder_runs": stats["encoder_runs"],
                                               "prefill_tokens_computed": stats["prefill_tokens_computed"],
                                               "prompt_tokens": stats["prompt_tokens"]}}
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    fresh = MMEngine(model, **kwargs)
    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    ttft = []
    for question in ("What happens in this clip?", "And what happens at the end of this clip?"):
        sync()
        start = time.perf_counter()
        fresh.generate(_video_prompt(question), videos=[clips[0]], sampling_params=first_token, use_tqdm=False)
        sync()
        ttft.append(time.perf_counter() - start)
    row["ttft_first_s"], row["ttft_second_s"] = ttft
    line = (f"[video     ] {len(jobs):3d} requests, {args.num_clips} clips x {patches} patches | mmengine: "
            f"{stats['encoder_runs'] / (args.num_clips * patches):.2f} encodes/patch, {len(jobs) / elapsed:7.2f} req/s | "
            f"TTFT first {ttft[0] * 1e3:.1f} ms, second {ttft[1] * 1e3:.1f} ms")
    if not args.skip_baseline:
        from transformers import AutoModelForImageTextToText

        processor, device, dtype = fresh.input_processor, fresh.device, fresh.dtype
        del fresh  # its KV cache leaves room for transformers' copy of the weights
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        hf = AutoModelForImageTextToText.from_pretrained(model, dtype=dtype).to(device).eval()
        start = time.perf_counter()
        with torch.inference_mode():
            for prompt, k in jobs:
                inputs = {name: t.to(device) for name, t in hf_video_inputs(processor, prompt, [], [clips[k]], args.clip_fps).items()}
                if "pixel_values_videos" in inputs:
                    inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(dtype)
                hf.generate(**inputs, do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len)
        base = time.perf_counter() - start
        row["transformers"] = {"elapsed_s": base, "encoder_runs": len(jobs) * patches}
        row["speedup"] = base / elapsed
        line += f" | transformers: {len(jobs) / args.num_clips:.2f} encodes/patch, {len(jobs) / base:7.2f} req/s | {row['speedup']:.1f}x"
    print(line)
    return row


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


IMAGE_SCENARIOS = ("identical", "same-image", "partial", "multi-turn")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--output", default="benchmarks/results/encoder_cache.json")
    parser.add_argument("--scenarios", default=",".join(IMAGE_SCENARIOS),
                        help=f"comma-separated, among {', '.join(IMAGE_SCENARIOS)}, video")
    parser.add_argument("--video-model", default=None, help="Qwen-VL checkpoint (default: the tiny Qwen2.5-VL)")
    parser.add_argument("--num-clips", type=int, default=2)
    parser.add_argument("--clip-seconds", type=float, default=8.0)
    parser.add_argument("--clip-fps", type=float, default=2.0, help="frames per second of the clips (all kept)")
    parser.add_argument("--clip-size", default="60x84", help="HxW of the frames")
    parser.add_argument("--video-max-model-len", type=int, default=4096)
    parser.add_argument("--build-video-spec", choices=sorted(VIDEO_SPECS), default=None,
                        help="build this published shape at --video-model first (random weights, bf16; once)")
    args = parser.parse_args(argv)
    chosen = args.scenarios.split(",")
    unknown = sorted(set(chosen) - {*IMAGE_SCENARIOS, "video"})
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}")

    model = args.model or str(tiny_llava_path())
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine_kwargs = {"device": args.device, "dtype": args.dtype, "max_model_len": 1024}
    if set(chosen) & set(IMAGE_SCENARIOS):
        probe = MMEngine(model, num_kv_blocks=1, **engine_kwargs)
        device, dtype = str(probe.device), probe.dtype
        del probe
    result = {"model": model, "args": vars(args), "machine": {"platform": platform.platform(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}}
    for name, waves in scenarios(args.num_requests).items():
        if name not in chosen:
            continue
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
    if "video" in chosen:
        result["video"] = run_video(args, engine_kwargs)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
