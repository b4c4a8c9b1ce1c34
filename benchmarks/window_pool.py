"""The sliding-window layers' own KV pool (Gemma 4): bytes per cached token and cached prefixes that fit.

    python benchmarks/window_pool.py                          # the tiny Gemma 4 on CPU
    python benchmarks/window_pool.py --model /path/to/gemma4  # a real checkpoint (a GPU for its weights)

Every mode gets KV tensors of the same bytes (--kv-blocks blocks of every layer): "every layer" keeps
every token's K/V in one pool (sliding_kv_ratio=None), the others split the bytes between the full-
attention pool and the window pool at each --ratios value. The workload: --prefixes distinct prompts of
--prompt-len tokens, one after another (one token generated each), then all of them again. Printed per
mode: the pools' blocks, KV bytes per token of context the full pool holds, how many prompts the second
pass found cached (prefill tokens it computed against the first pass's), and the longest prompt the
cache admits. JSON goes to --output.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import write_json  # noqa: E402  (a sibling script)

from mmengine import MMEngine, SamplingParams  # noqa: E402
from mmengine.runner.kv_tensors import WindowPool, kv_pool_bytes  # noqa: E402
from mmengine.testing.gemma4 import TinyGemma4Spec, tiny_gemma4_path  # noqa: E402


def _prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct from their first token on, ordinary tokens only (below every special one)."""
    rng = random.Random(0)
    return [[10 + i, *(rng.randrange(10, 10 + vocab) for _ in range(length - 1))] for i in range(num)]


def _engine(path: str, ratio: float | None, full_blocks: int, args: argparse.Namespace) -> MMEngine:
    return MMEngine(path, device=args.device, dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
                    max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=full_blocks, max_num_seqs=1,
                    sliding_kv_ratio=ratio, async_scheduling="off")


def _full_blocks(engine: MMEngine, ratio: float, budget: int, args: argparse.Namespace) -> int:
    """The most full-pool blocks whose window pool (its ratio of them, at least its minimum) fits `budget` bytes."""
    windows = engine.family.kv_cache_windows()
    full, windowed = kv_pool_bytes(engine.family.kv_cache_layout(), windows, args.block_size, engine.runner.kv_element_bytes)
    pool = WindowPool.plan(next(w for w in windows if w is not None), ratio, args.block_size, args.max_num_batched_tokens,
                           args.max_model_len)
    blocks = budget // full
    while blocks * full + pool.blocks_for(blocks) * windowed > budget:
        blocks -= 1
    return blocks


def _run_mode(engine: MMEngine, args: argparse.Namespace) -> dict:
    runner = engine.runner
    kv_bytes = sum(group.numel() * group.element_size() for group in runner.kv_cache.groups)
    vocab = min(300, len(engine.tokenizer)) - 10
    prompts = _prompts(args.prefixes, args.prompt_len, vocab)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    passes = []
    for _ in range(2):
        before = engine.stats()["prefill_tokens_computed"]
        hits = 0
        for ids in prompts:
            out = engine.generate({"prompt_token_ids": ids}, sampling_params=params, use_tqdm=False)[0]
            hits += out.num_cached_tokens >= args.prompt_len - args.block_size
        passes.append({"prefill_tokens_computed": engine.stats()["prefill_tokens_computed"] - before, "prompts_hit": hits})
    stats = engine.stats()
    return {
        "sliding_kv_ratio": engine.config.cache_config.sliding_kv_ratio,
        "kv_bytes": kv_bytes,
        "full_blocks": engine.kv_cache.num_blocks,
        "window_blocks": runner.num_window_blocks,
        "kv_bytes_per_context_token": kv_bytes / (engine.kv_cache.num_blocks * args.block_size),
        "first_pass": passes[0],
        "second_pass": passes[1],
        "window_blocks_freed": stats["kv_window_blocks_freed"],
        "longest_prompt": engine.input_processor.max_tokens_in_kv_cache,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Gemma 4 checkpoint (default: the tiny one)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=64, help="the KV bytes of this many blocks of every layer, in each mode")
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--ratios", default="0.5,0.25", help="sliding_kv_ratio values besides every layer keeping every token")
    parser.add_argument("--output", default="benchmarks/results/window_pool.json")
    args = parser.parse_args(argv)

    path = args.model or str(tiny_gemma4_path(TinyGemma4Spec()))
    result = {"model": path, "platform": platform.platform(), "torch": torch.__version__, "args": vars(args), "modes": {}}
    every_layer = _engine(path, None, args.kv_blocks, args)
    budget = sum(group.numel() * group.element_size() for group in every_layer.runner.kv_cache.groups)
    for ratio in [None, *(float(r) for r in args.ratios.split(","))]:
        name = "every layer" if ratio is None else f"window pool {ratio}"
        engine = every_layer if ratio is None else _engine(path, ratio, _full_blocks(every_layer, ratio, budget, args), args)
        run = _run_mode(engine, args)
        del engine
        result["modes"][name] = run
        second = run["second_pass"]
        print(f"{name:18s} {run['kv_bytes']:>10} KV bytes: {run['full_blocks']:4d} full + {run['window_blocks']:4d} window blocks, "
              f"{run['kv_bytes_per_context_token']:8.0f} bytes per token of context, longest prompt {run['longest_prompt']:5d}; "
              f"second pass: {second['prompts_hit']}/{args.prefixes} prompts cached, prefill "
              f"{second['prefill_tokens_computed']} of {run['first_pass']['prefill_tokens_computed']} tokens")
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
