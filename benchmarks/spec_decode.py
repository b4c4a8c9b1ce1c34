"""Speculative decoding: the same greedy batch with and without drafts; decode steps, acceptance, tokens/s.

The workload asks the model to repeat a passage (`--passage-len` words, each prompt its own), where prompt
lookup has something to find. Each mode runs the same prompts in one generate() call and the answers are
checked equal (greedy: speculation never changes a token):

  off      no speculation
  ngram    speculative_config {"method": "ngram", "num_speculative_tokens": K, prompt lookup 1..3}
  mtp      (--method mtp) {"method": "mtp", "num_speculative_tokens": K}: the checkpoint's own MTP head (the
           tiny Qwen3.5 gets a random one, so nearly every draft is rejected: the row is the cost of a k+1-token
           verify step plus the head against a 1-token decode, the number that decides when MTP pays)
  oracle   the same engine with drafts taken from the "off" answers (every draft right): the upper bound
           of what verify steps give at full acceptance on this device, not a proposer anyone can use

A random-weight checkpoint does not repeat its prompt, so on one the ngram row shows the cost of drafts
that are mostly rejected; the oracle row shows what full acceptance saves. With a real checkpoint
(--model) the ngram row is the figure that matters.

    python benchmarks/spec_decode.py                          # tiny Qwen3.5 (hybrid) on CPU
    python benchmarks/spec_decode.py --family llava --num-speculative-tokens 4
    python benchmarks/spec_decode.py --method mtp             # tiny Qwen3.5 with a random MTP head
    python benchmarks/spec_decode.py --model /path/to/Qwen3.5-9B --device cuda --output-len 256
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import write_json  # noqa: E402  (a sibling script)

from mmengine import MMEngine, SamplingParams  # noqa: E402
from mmengine.testing import TINY_QWEN3_5_SPEC, TinyLlavaSpec, tiny_llava_path, tiny_qwen_vl_path  # noqa: E402
from mmengine.testing.mtp import tiny_qwen3_5_mtp_path  # noqa: E402
from mmengine.testing.qwen_vl import qwen_vl_prompt  # noqa: E402

WORDS = "the picture shows a red house with a green door next to an old tree under a grey sky".split()


class _Oracle:
    """Drafts from known answers, by prompt (the benchmark's upper bound)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.answers, self.k = answers, k

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        for prompt, answer in self.answers.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return answer[done : done + min(self.k, max_drafts)]
        return []

    def forget(self, request_id: str) -> None:
        pass


def _prompts(family: str, count: int, passage_len: int) -> list[str]:
    prompts = []
    for i in range(count):
        rng = random.Random(i)
        passage = " ".join(rng.choice(WORDS) for _ in range(passage_len))
        text = f"Repeat this exactly: {passage}"
        prompts.append(qwen_vl_prompt(text, 0) if family == "qwen3_5" else f"USER: {text} ASSISTANT:")
    return prompts


def _verify_replays(engine: MMEngine) -> int:
    graphs = engine.runner.decode_graphs
    return graphs.num_verify_replays if graphs is not None else 0


def _run(engine: MMEngine, prompts: list[str], params: SamplingParams) -> tuple[dict, list]:
    before, replays = engine.stats(), _verify_replays(engine)
    start = time.perf_counter()
    outs = engine.generate(prompts, sampling_params=params, use_tqdm=False)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    seconds = time.perf_counter() - start
    after = engine.stats()
    delta = {k: after[k] - before.get(k, 0) for k in after
             if k.startswith("spec_") or k in ("steps", "decode_steps", "generation_tokens", "steps_launched_ahead")}
    drafted = delta.get("spec_draft_tokens", 0)
    return {
        "seconds": round(seconds, 4),
        "output_tokens_per_s": round(delta["generation_tokens"] / seconds, 1),
        "decode_steps": delta["decode_steps"],
        "draft_tokens": drafted,
        "accepted_tokens": delta.get("spec_accepted_tokens", 0),
        "acceptance": round(delta.get("spec_accepted_tokens", 0) / drafted, 3) if drafted else None,
        "tokens_per_decode_step": round(delta["generation_tokens"] / max(1, delta["decode_steps"]), 2),
        "decode_steps_per_output_token": round(delta["decode_steps"] / max(1, delta["generation_tokens"]), 3),
        # of the drafts at position j (0: the first after the request's last token), the share kept
        "acceptance_by_position": [round(delta.get(f"spec_accepted_position_{j}", 0) / delta[f"spec_drafted_position_{j}"], 3)
                                   if delta.get(f"spec_drafted_position_{j}") else None for j in range(_positions(delta))],
        "ms_per_decode_step": round(1000 * seconds / max(1, delta["decode_steps"]), 3),
        # verify steps replayed from CUDA graphs (the others ran eager: prompt chunks in the step, adapters)
        "verify_graph_replays": _verify_replays(engine) - replays,
        # with async scheduling: the share of steps launched before the tokens of the one in flight were read
        "launched_ahead_share": round(delta["steps_launched_ahead"] / max(1, delta["steps"]), 3),
    }, outs


def _positions(delta: dict) -> int:
    return sum(1 for k in delta if k.startswith("spec_drafted_position_"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint (default: the tiny one of --family)")
    parser.add_argument("--family", default="qwen3_5", choices=["qwen3_5", "llava"], help="the tiny checkpoint's family")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--passage-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--method", default="ngram", choices=["ngram", "mtp"],
                        help="the proposer measured (mtp: the checkpoint's head; the tiny Qwen3.5 gets a random one)")
    parser.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                        help="launch each step before the one in flight is read (auto: on with CUDA)")
    parser.add_argument("--output", default="benchmarks/results/spec_decode.json")
    args = parser.parse_args(argv)

    if args.model:
        path = Path(args.model)
    elif args.method == "mtp":
        path = tiny_qwen3_5_mtp_path()
    else:
        path = tiny_qwen_vl_path(TINY_QWEN3_5_SPEC) if args.family == "qwen3_5" else tiny_llava_path(TinyLlavaSpec())
    prompts = _prompts(args.family, args.num_prompts, args.passage_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3} if args.method == "ngram" else {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    result = {"model": str(path), "platform": platform.platform(), "torch": torch.__version__, "runs": {}}
    plain = MMEngine(str(path), device=args.device, dtype=args.dtype, async_scheduling=args.async_scheduling)
    _run(plain, prompts[:1], params)  # warm-up
    result["runs"]["off"], reference = _run(plain, prompts, params)
    result["device"] = str(plain.device)
    del plain
    engine = MMEngine(str(path), device=args.device, dtype=args.dtype, speculative_config=spec,
                      async_scheduling=args.async_scheduling)
    _run(engine, prompts[:1], params)
    result["runs"][args.method], outs = _run(engine, prompts, params)
    method_equal = [o.token_ids for o in outs] == [r.token_ids for r in reference]
    # the oracle stands in for the proposer (and the head, with mtp: its steps are not run)
    proposer, drafter = engine.steps.drafts.proposer, engine.steps.drafts.drafter
    engine.steps.drafts.proposer, engine.steps.drafts.drafter = _Oracle(
        {tuple(r.prompt_token_ids): list(r.token_ids) for r in reference}, args.num_speculative_tokens), None
    result["runs"]["oracle"], outs = _run(engine, prompts, params)
    engine.steps.drafts.proposer, engine.steps.drafts.drafter = proposer, drafter
    result["answers_equal"] = method_equal and [o.token_ids for o in outs] == [r.token_ids for r in reference]
    base = result["runs"]["off"]["output_tokens_per_s"]
    for mode, run in result["runs"].items():
        run["speedup"] = round(run["output_tokens_per_s"] / base, 2)
        run["step_cost"] = round(run["ms_per_decode_step"] / result["runs"]["off"]["ms_per_decode_step"], 2)
        print(f"{mode:7s} {run['output_tokens_per_s']:9.1f} tok/s ({run['speedup']:.2f}x)  decode steps {run['decode_steps']:5d}  "
              f"{run['ms_per_decode_step']:8.2f} ms/step ({run['step_cost']:.2f}x)  "
              f"tokens/step {run['tokens_per_decode_step']:5.2f}  drafts {run['draft_tokens']:5d} accepted "
              f"{run['accepted_tokens']:5d}" + (f" ({run['acceptance']:.0%})" if run["acceptance"] is not None else "")
              + (f"  by position {' '.join('-' if a is None else f'{a:.0%}' for a in run['acceptance_by_position'])}"
                 if run["acceptance_by_position"] else ""))
    print(f"answers equal with and without speculation: {result['answers_equal']}")
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
