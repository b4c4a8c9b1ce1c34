"""Beam search at widths 1, 2, 4 and 8 on image prompts: time per request and the work done (prefill
tokens computed, encoder runs), next to running the same number of sequences as independent
requests (W sampled requests per prompt, each generating max_tokens).

    python benchmarks/beam_search.py                                   # tiny built-in model (CPU)
    python benchmarks/beam_search.py --build-7b /tmp/llava-1.5-7b --num-prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import WORDS, _positive_ints, add_model_source, run_record, resolve_model, sync, write_json  # noqa: E402  (a sibling script)

from mmengine import BeamSearchParams, MMEngine, SamplingParams  # noqa: E402
from mmengine.testing import make_test_image  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(parser)
    parser.add_argument("--widths", type=_positive_ints, default=[1, 2, 4, 8])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", default="benchmarks/results/beam_search.json")
    return parser.parse_args(argv)


def _measure(engine: MMEngine, run) -> dict:
    before = engine.stats()
    sync(engine.device)
    start = time.perf_counter()
    run()
    sync(engine.device)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    return {"elapsed_s": elapsed, "prefill_tokens_computed": after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
            "tokens_computed": after["tokens_computed"] - before["tokens_computed"],
            "encoder_runs": after["encoder_runs"] - before["encoder_runs"]}


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model, origin = resolve_model(args)
    prompts = [f"USER: <image>\n{' '.join(WORDS[(i + j) % len(WORDS)] for j in range(10))}? ASSISTANT:" for i in range(args.num_prompts)]
    pictures = [[make_test_image(900 + i, size=(320, 240))] for i in range(args.num_prompts)]
    rows = []
    for width in args.widths:
        engine = MMEngine(model, max_model_len=args.max_model_len, device=args.device)
        engine.generate(prompts[:1], images=pictures[:1], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        engine.reset_prefix_cache()
        engine.reset_encoder_cache()
        params = BeamSearchParams(beam_width=width, max_tokens=args.max_tokens, ignore_eos=True)
        beams = _measure(engine, lambda: engine.beam_search(prompts, params, images=pictures))
        engine.reset_prefix_cache()
        engine.reset_encoder_cache()
        sampled = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=True)
        independent = _measure(engine, lambda: engine.generate([p for p in prompts for _ in range(width)],
                                                                images=[i for i in pictures for _ in range(width)],
                                                                sampling_params=sampled, use_tqdm=False))
        row = {"width": width, "beam_search": beams, "independent_requests": independent,
               "beam_ms_per_prompt": 1e3 * beams["elapsed_s"] / args.num_prompts,
               "independent_ms_per_prompt": 1e3 * independent["elapsed_s"] / args.num_prompts}
        rows.append(row)
        print(f"width {width}: beam search {row['beam_ms_per_prompt']:.1f} ms/prompt, {beams['prefill_tokens_computed']} prefill "
              f"tokens, {beams['encoder_runs']} encoder runs | independent {row['independent_ms_per_prompt']:.1f} ms/prompt, "
              f"{independent['prefill_tokens_computed']} prefill tokens")
    result = {**run_record(model, origin, args), "widths": rows}
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
