"""Shared-prefix workloads: prefix-cache hit rate, prefill work versus the minimum, and throughput.

Two workload shapes:
  vllm    vLLM's benchmark_prefix_caching: every prompt = one shared prefix of --prefix-len tokens
          + a random suffix in --input-len-range, the prompt set repeated --repeat-count times.
  sglang  SGLang's generated-shared-prefix: --num-groups groups, each with its own system prompt of
          --system-prompt-len tokens and --prompts-per-group questions of --question-len tokens.
With --with-images each prefix (or group) also shows an image, so the image is part of the shared prefix.
Prompts are shuffled. Both runs use the same engine settings, with prefix caching on and off.

    python benchmarks/prefix_cache.py                      # both shapes on the built-in tiny model
    python benchmarks/prefix_cache.py --model PATH --scenario sglang --num-groups 16 --prompts-per-group 32
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
from mmengine.testing import make_test_image, tiny_llava_path


def _text(rng: random.Random, tokenizer, num_tokens: int) -> str:
    """Random words, trimmed to about num_tokens tokens."""
    vocab = ["alpha", "boat", "river", "stone", "cloud", "green", "light", "north", "paper", "quiet", "seven", "tower"]
    words = [rng.choice(vocab) for _ in range(num_tokens)]
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


def vllm_workload(args, tokenizer, rng):
    prefix = _text(rng, tokenizer, args.prefix_len)
    image = make_test_image(0) if args.with_images else None
    lo, hi = (int(x) for x in args.input_len_range.split(":"))
    base = []
    for _ in range(args.num_prompts):
        suffix = _text(rng, tokenizer, rng.randint(lo, hi))
        marker = "<image>\n" if image else ""
        base.append((f"USER: {marker}{prefix} {suffix} ASSISTANT:", [image] if image else []))
    prompts = base * args.repeat_count
    rng.shuffle(prompts)
    return prompts


def sglang_workload(args, tokenizer, rng):
    prompts = []
    for group in range(args.num_groups):
        system = _text(rng, tokenizer, args.system_prompt_len)
        image = make_test_image(group) if args.with_images else None
        marker = "<image>\n" if image else ""
        for _ in range(args.prompts_per_group):
            question = _text(rng, tokenizer, args.question_len)
            prompts.append((f"SYSTEM: {marker}{system} USER: {question} ASSISTANT:", [image] if image else []))
    rng.shuffle(prompts)
    return prompts


def unique_tokens(token_lists: list[list[int]], images: list[list]) -> int:
    """Prefill work with perfect token-level sharing: the size of the trie of all prompts."""
    trie: dict = {}
    count = 0
    for ids, imgs in zip(token_lists, images):
        node = trie.setdefault(tuple(id(i) for i in imgs), {})  # prompts with different images never share
        for token in ids:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


def run(model: str, prompts, args, enable_prefix_caching: bool) -> dict:
    engine = MMEngine(model, enable_prefix_caching=enable_prefix_caching, device=args.device, dtype=args.dtype,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate([p for p, _ in prompts], images=[i for _, i in prompts], sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    token_lists = [o.prompt_token_ids for o in outputs]
    total_prompt = sum(map(len, token_lists))
    return {
        "prefix_caching": enable_prefix_caching,
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "total_tokens_per_s": (total_prompt + sum(len(o.token_ids) for o in outputs)) / elapsed,
        "prompt_tokens": total_prompt,
        "prefill_tokens_computed": stats["prefill_tokens_computed"],
        "prefill_tokens_minimum": unique_tokens(token_lists, [i for _, i in prompts]),
        "hit_rate": stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]),
        "stats": stats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--scenario", choices=["vllm", "sglang", "both"], default="both")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--input-len-range", default="16:48")
    parser.add_argument("--repeat-count", type=int, default=2)
    parser.add_argument("--num-groups", type=int, default=4)
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-prompt-len", type=int, default=256)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--with-images", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/prefix_cache.json")
    args = parser.parse_args()

    model = args.model or str(tiny_llava_path())
    tokenizer = MMEngine(model, max_model_len=args.max_model_len, num_kv_blocks=1, device="cpu").tokenizer
    scenarios = ["vllm", "sglang"] if args.scenario == "both" else [args.scenario]
    result = {"model": model, "args": vars(args), "machine": {
        "platform": platform.platform(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}}
    for scenario in scenarios:
        rng = random.Random(args.seed)
        prompts = (vllm_workload if scenario == "vllm" else sglang_workload)(args, tokenizer, rng)
        on, off = run(model, prompts, args, True), run(model, prompts, args, False)
        result[scenario] = {"cached": on, "uncached": off, "speedup": on["requests_per_s"] / off["requests_per_s"]}
        print(f"[{scenario}] {len(prompts)} prompts, {on['prompt_tokens']} prompt tokens")
        for r in (on, off):
            label = "prefix cache on " if r["prefix_caching"] else "prefix cache off"
            print(f"  {label}: hit rate {r['hit_rate']:6.1%}  prefill computed {r['prefill_tokens_computed']:7d} "
                  f"(minimum {r['prefill_tokens_minimum']})  {r['requests_per_s']:7.2f} req/s  "
                  f"{r['total_tokens_per_s']:9.1f} tok/s")
        print(f"  speedup: {result[scenario]['speedup']:.2f}x")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
