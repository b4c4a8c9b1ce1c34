"""Prefix caching on a hybrid decoder (Qwen3.5): a multi-turn image chat and a shared system prompt.

    python benchmarks/hybrid_prefix.py                                   # tiny Qwen3.5 on CPU
    python benchmarks/hybrid_prefix.py --build-9b /tmp/qwen3.5-9b        # the published 9B shape, on a GPU

Two workloads, each on a fresh engine with prefix caching on and again with it off (what vLLM users
get today on Qwen3.5 below 528 tokens: vllm#40696):
  chat     --turns turns of one conversation about one picture: each turn's prompt is the previous
           prompt, its answer (--output-len tokens, greedy, EOS ignored) and a new question;
  system   --requests prompts, one after another, sharing a --system-len token system prompt and
           adding --tail-len tokens each.
Printed per workload and mode: prefill tokens computed against the minimum (every token once), the
checkpoints saved and hit and their bytes, and the time to first token of each turn (chat: the last
turn's against the first; system: the mean from the third request on against the first). JSON goes to
--output.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import ensure_checkpoint, sync, write_json  # noqa: E402  (a sibling script)

from mmengine import MMEngine, SamplingParams  # noqa: E402
from mmengine.testing import QWEN3_5_9B_SPEC, TINY_QWEN3_5_SPEC, make_test_image, tiny_qwen_vl_path  # noqa: E402
from mmengine.testing.qwen_vl import qwen_vl_prompt  # noqa: E402


def _timed(engine: MMEngine, prompt: dict, images: list | None, params: SamplingParams) -> tuple[float, int, list[int], list[int]]:
    """(seconds to the first token, prompt tokens computed, prompt ids, output ids) of one request."""
    before = engine.stats()["prefill_tokens_computed"]
    sync(engine.device)
    start = time.perf_counter()
    engine.add_request(prompt, images=images, sampling_params=params, request_id=f"r{before}-{start}")
    ttft, out = None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if ttft is None and output.token_ids:
                ttft = time.perf_counter() - start
            if output.finished:
                out = output
    return ttft, engine.stats()["prefill_tokens_computed"] - before, list(out.prompt_token_ids), list(out.token_ids)


def chat(engine: MMEngine, turns: int, output_len: int, picture) -> dict:
    # a random-weight model may emit a placeholder token, which a token prompt must not hold outside a picture
    placeholders = {engine.family.image_token_id: -100.0, engine.family.video_token_id: -100.0}
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, logit_bias=placeholders)
    tokenizer = engine.tokenizer
    history = tokenizer.encode(qwen_vl_prompt("What is in this picture? Describe it.", 1))
    ttfts, computed, minimum = [], 0, 0
    for turn in range(turns):
        if turn:
            history += tokenizer.encode(f"<|im_end|>\n<|im_start|>user\nTell me more about part {turn}.<|im_end|>\n"
                                        "<|im_start|>assistant\n")
        before = len(history)
        ttft, cost, prompt_ids, output = _timed(engine, {"prompt_token_ids": history}, [picture], params)
        minimum += len(prompt_ids) - (minimum_seen if turn else 0)  # noqa: F821 - set below
        minimum_seen = len(prompt_ids) + len(output)
        ttfts.append(ttft)
        computed += cost
        history = prompt_ids + output
        assert len(prompt_ids) >= before
    return {"ttft_s": ttfts, "prefill_tokens_computed": computed, "prefill_tokens_minimum": minimum,
            "ttft_last_over_first": ttfts[-1] / ttfts[0]}


def system(engine: MMEngine, requests: int, system_len: int, tail_len: int, vocab: int) -> dict:
    rng = random.Random(0)
    shared = [rng.randrange(10, 10 + vocab) for _ in range(system_len)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ttfts, computed = [], 0
    for _ in range(requests):
        ids = shared + [rng.randrange(10, 10 + vocab) for _ in range(tail_len)]
        ttft, cost, _, _ = _timed(engine, {"prompt_token_ids": ids}, None, params)
        ttfts.append(ttft)
        computed += cost
    later = ttfts[2:] or ttfts[-1:]
    return {"ttft_s": ttfts, "prefill_tokens_computed": computed, "prefill_tokens_minimum": system_len + requests * tail_len,
            "ttft_later_over_first": sum(later) / len(later) / ttfts[0]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Qwen3.5 checkpoint (default: the tiny one)")
    parser.add_argument("--build-9b", help="build (once) and use a random-weight Qwen3.5-9B-shaped bf16 checkpoint here")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=70)
    parser.add_argument("--tail-len", type=int, default=20)
    parser.add_argument("--picture-size", type=int, default=448)
    parser.add_argument("--output", default="benchmarks/results/hybrid_prefix.json")
    args = parser.parse_args(argv)

    if args.build_9b:
        path, built = ensure_checkpoint(Path(args.build_9b), QWEN3_5_9B_SPEC, "cuda", "bfloat16")
        print(f"checkpoint {path} (built in {built:.0f} s)" if built else f"checkpoint {path}")
    else:
        path = Path(args.model) if args.model else tiny_qwen_vl_path(TINY_QWEN3_5_SPEC)
    picture = make_test_image(5, size=(args.picture_size, args.picture_size))
    result = {"model": str(path), "platform": platform.platform(), "torch": torch.__version__, "runs": {}}
    for caching in (True, False):
        mode = "prefix caching on" if caching else "prefix caching off"
        for workload in ("chat", "system"):
            engine = MMEngine(str(path), device=args.device, dtype=args.dtype, enable_prefix_caching=caching,
                              async_scheduling="off")
            if workload == "chat":
                run = chat(engine, args.turns, args.output_len, picture)
                ratio = f"TTFT turn {args.turns} / turn 1 {run['ttft_last_over_first']:.2f}"
            else:
                plain_ids = min(300, len(engine.tokenizer)) - 10  # ordinary tokens, below every special one
                run = system(engine, args.requests, args.system_len, args.tail_len, plain_ids)
                ratio = f"TTFT from the 3rd on / 1st {run['ttft_later_over_first']:.2f}"
            stats = engine.stats()
            run.update({k: stats[k] for k in ("state_checkpoints_saved", "state_checkpoint_hits", "state_checkpoints_cached",
                                              "state_checkpoint_bytes", "encoder_runs")})
            run["device"] = str(engine.device)
            result["runs"][f"{workload} / {mode}"] = run
            print(f"{workload:6s} {mode:18s} prefill computed {run['prefill_tokens_computed']:6d} / minimum "
                  f"{run['prefill_tokens_minimum']:6d} = {run['prefill_tokens_computed'] / run['prefill_tokens_minimum']:.2f}x  "
                  f"checkpoints saved {run['state_checkpoints_saved']} hit {run['state_checkpoint_hits']} "
                  f"({run['state_checkpoint_bytes']} bytes each)  encoder runs {run['encoder_runs']}  {ratio}")
            del engine
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
