"""Multi-LoRA throughput: the same image workload with 0, 1, 4 and 16 adapters (ranks 8 and 64),
next to the run without LoRA, and the steady decode step time at one batch size with every row
under an adapter against the same batch without.

Adapters are random (mmengine.testing.lora.build_random_adapter) on every projection of the
language model; requests take them round robin. Reported per run: requests/s, output tokens/s, the
ratio to the no-LoRA run, adapter slot loads and evictions, prefill tokens computed.

    python benchmarks/lora.py                                          # tiny built-in model (CPU)
    python benchmarks/lora.py --build-7b /tmp/llava-1.5-7b --num-requests 256 --decode-batch-size 64 \\
        --adapters 0,1,4,8,16 --ranks 16,64 --output-len 64            # the LLaVA-1.5-7B shape on a GPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import WORDS, _positive_ints, add_model_source, run_record, non_negative_ints, resolve_model, sync, write_json  # noqa: E402  (a sibling script)

from mmengine import LoRARequest, MMEngine, SamplingParams  # noqa: E402
from mmengine.testing import make_test_image  # noqa: E402
from mmengine.testing.lora import build_random_adapter  # noqa: E402


def workload(num_requests: int, unique_images: int, words: int) -> tuple[list[str], list[list]]:
    pictures = [make_test_image(500 + i, size=(320, 240)) for i in range(unique_images)]
    prompts = [f"USER: <image>\n{' '.join(WORDS[(i + j) % len(WORDS)] for j in range(words))}? ASSISTANT:"
               for i in range(num_requests)]
    return prompts, [[pictures[i % unique_images]] for i in range(num_requests)]


def run(model: str, adapters: list[Path], rank: int, args: argparse.Namespace, prompts: list[str], images: list[list]) -> dict:
    options = dict(max_model_len=args.max_model_len, device=args.device)
    if adapters:
        options |= dict(enable_lora=True, max_loras=min(len(adapters), args.max_loras), max_lora_rank=rank)
    engine = MMEngine(model, **options)
    loras = [LoRARequest(f"a{i % len(adapters)}", str(adapters[i % len(adapters)])) for i in range(len(prompts))] if adapters else None
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], images=images[:2], sampling_params=params, lora=loras[:2] if loras else None, use_tqdm=False)  # warm-up
    engine.reset_prefix_cache()
    before = engine.stats()
    sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, images=images, sampling_params=params, lora=loras, use_tqdm=False)
    sync(engine.device)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    return {
        "adapters": len(adapters), "rank": rank if adapters else 0, "elapsed_s": elapsed,
        "requests_per_s": len(outs) / elapsed, "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / elapsed,
        "prefill_tokens_computed": after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
        "lora_slot_loads": after.get("lora_slot_loads", 0) - before.get("lora_slot_loads", 0),
        "lora_slot_evictions": after.get("lora_slot_evictions", 0) - before.get("lora_slot_evictions", 0),
        "decode_step_ms": decode_step_ms(engine, adapters, args),
    }


def decode_step_ms(engine: MMEngine, adapters: list[Path], args: argparse.Namespace) -> float:
    """Mean time of a decode-only step at --decode-batch-size, every row under an adapter (round robin) if any."""
    size = args.decode_batch_size
    params = SamplingParams(max_tokens=args.decode_steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(size):
        lora = LoRARequest(f"a{i % len(adapters)}", str(adapters[i % len(adapters)])) if adapters else None
        engine.add_request(f"{WORDS[i % len(WORDS)]} {i} is", sampling_params=params, lora=lora)
    for _ in range(3):  # prefill, then the batch decodes
        engine.step()
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(args.decode_steps):
        engine.step()
    sync(engine.device)
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * elapsed / args.decode_steps


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(parser)
    parser.add_argument("--adapters", type=non_negative_ints, default=[0, 1, 4, 16], help="adapter counts to run (0: no LoRA)")
    parser.add_argument("--ranks", type=_positive_ints, default=[8, 64])
    parser.add_argument("--max-loras", type=int, default=16, help="device slots (capped at the adapter count)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--unique-images", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=12)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--decode-batch-size", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", default="benchmarks/results/lora.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model, origin = resolve_model(args)
    prompts, images = workload(args.num_requests, args.unique_images, args.prompt_words)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmengine-lora-bench-") as tmp:
        dtype = "bfloat16" if args.build_7b else "float32"
        for rank in args.ranks:
            for count in args.adapters:
                if count == 0 and rank != args.ranks[0]:
                    continue  # the no-LoRA run does not depend on the rank
                adapters = [build_random_adapter(model, Path(tmp) / f"r{rank}-{i}", rank, seed=i, dtype=dtype) for i in range(count)]
                rows.append(run(model, adapters, rank, args, prompts, images))
                print(f"adapters {count:>2} rank {rows[-1]['rank']:>2}: {rows[-1]['requests_per_s']:8.2f} req/s, "
                      f"decode step {rows[-1]['decode_step_ms']:.2f} ms, slot loads {rows[-1]['lora_slot_loads']}")
    base = next(r for r in rows if r["adapters"] == 0) if any(r["adapters"] == 0 for r in rows) else None
    for row in rows:
        if base is not None:
            row["throughput_vs_no_lora"] = row["requests_per_s"] / base["requests_per_s"]
            row["decode_step_vs_no_lora"] = row["decode_step_ms"] / base["decode_step_ms"]
    result = {**run_record(model, origin, args), "runs": rows}
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
