"""Shared-prefix batches (the BatchLLM / vLLM RFC #12080 shape): arrival order, sorted, grouped.

    python benchmarks/shared_prefix.py                         # tiny model on CPU: 8 groups x 8, 64 + 16 tokens
    python benchmarks/shared_prefix.py --num-kv-blocks 24      # ... under KV pressure (the issue's CPU workload)
    python benchmarks/shared_prefix.py --build-7b /tmp/llava-1.5-7b --groups 16 --degree 32 \\
        --shared-len 2020 --unique-len 200 --output-len 100    # the RFC shape at the LLaVA-1.5-7B shape, on a GPU

`--groups` groups of `--degree` prompts each: a group shares its first `--shared-len` tokens (with
`--images` pictures inside them, different per group) and each prompt adds `--unique-len` tokens of
its own, then generates `--output-len` tokens (greedy, EOS ignored). Prompt lengths are exact: words
that are one token each. With --shuffle (default) prompts arrive in random order. One run executes,
each on a fresh engine with prefix caching on:
  arrival          the prompts in arrival order (grouping off: LRU prefix caching only)
  sorted           the prompts sorted by text (vLLM's --sort; grouping off)
  grouped          arrival order, enable_prefix_grouping=True
  grouped+cascade  grouped with cascade_attention set to each value of --cascade (skipped, with a
                   note, when this EngineConfig has no cascade_attention option)
Modes without cascade run with cascade_attention="off" where the option exists.

Printed per mode: requests/s, prefill tokens computed against the minimum (each shared prefix once
plus every unique suffix), and, on a GPU, decode attention time
per step: the device time of kernels matching --attention-kernels over --profile-steps steps starting
at step --profile-start (torch.profiler; n/a on CPU, where the attention is plain PyTorch). JSON goes
to --output.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import ensure_checkpoint, sync, write_json  # noqa: E402  (a sibling script)

from mmengine import MMEngine, SamplingParams  # noqa: E402
from mmengine.config import EngineConfig  # noqa: E402
from mmengine.testing import LLAVA_1_5_7B_SPEC, TinyLlavaSpec, make_test_image, tiny_llava_path  # noqa: E402

BASE_MODES = ("arrival", "sorted", "grouped")
HAS_CASCADE = "cascade_attention" in {f.name for _, f in EngineConfig.option_fields()}


@dataclasses.dataclass
class Prompt:
    text: str
    images: list
    group: int


# -- workload -------------------------------------------------------------------------------------


def single_token_words(tokenizer, limit: int = 4000) -> list[str]:
    """Alphabetic words that tokenize to exactly one token after a space (so " w1 w2 ..." has one
    token per word)."""
    words = []
    for token_id in sorted(tokenizer.get_vocab().values()):
        word = tokenizer.decode([token_id]).strip()
        if word.isalpha() and word.isascii() and tokenizer(" " + word, add_special_tokens=False)["input_ids"] == [token_id]:
            words.append(word)
            if len(words) >= limit:
                break
    if len(words) < 8:
        raise SystemExit(f"the tokenizer has only {len(words)} one-token words; cannot build exact-length prompts")
    return words


def tokens_per_image(engine: MMEngine, image_marker: str) -> int:
    """Placeholder tokens one image expands to, measured through the public API."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with_image = engine.generate(image_marker, images=[make_test_image(99_999)], sampling_params=params, use_tqdm=False)
    without = engine.generate("x", sampling_params=params, use_tqdm=False)
    return len(with_image[0].prompt_token_ids) - len(without[0].prompt_token_ids) + 1


def build_workload(args: argparse.Namespace, words: list[str], image_tokens: int, image_marker: str) -> list[Prompt]:
    """Prompts of exactly shared_len + unique_len tokens (BOS included), in arrival order."""
    rng = random.Random(args.seed)
    text_shared = args.shared_len - 1 - args.images * image_tokens  # BOS, the images, then words
    if text_shared < 0:
        raise SystemExit(f"--shared-len {args.shared_len} cannot hold BOS and {args.images} image(s) of {image_tokens} tokens")
    prompts = []
    for group in range(args.groups):
        pieces = [" " + rng.choice(words) for _ in range(text_shared)]
        images = [make_test_image(1000 * group + i) for i in range(args.images)]
        step = text_shared // (args.images + 1)
        for i in reversed(range(args.images)):  # spread through the shared part, at offsets that cross blocks
            pieces.insert(min(len(pieces), 5 + i * step), image_marker)
        shared = "".join(pieces)
        for _ in range(args.degree):
            unique = "".join(" " + rng.choice(words) for _ in range(args.unique_len))
            prompts.append(Prompt(shared + unique, images, group))
    if args.shuffle:
        rng.shuffle(prompts)
    return prompts


def check_lengths(tokenizer, prompts: list[Prompt], image_tokens: int, expected: int) -> None:
    for prompt in prompts[:8]:
        n = len(tokenizer(prompt.text)["input_ids"]) + len(prompt.images) * (image_tokens - 1)
        if n != expected:
            raise SystemExit(f"a prompt tokenizes to {n} tokens, not {expected}: this tokenizer merges the words")


# -- decode attention time ------------------------------------------------------------------------


class AttentionProfiler:
    """Profiles engine steps [start, start + count) on a GPU (wrapping the runner's execute) and
    sums the device time of kernels whose names match `pattern`."""

    def __init__(self, engine: MMEngine, start: int, count: int, pattern: str) -> None:
        self.engine, self.start, self.count, self.pattern = engine, start, count, re.compile(pattern)
        self.step = 0
        self.profiled_steps = 0
        self.decodes = 0
        self._prof = None
        self._execute = engine.runner.execute
        self._wrapping = engine.device.type == "cuda" and count > 0
        if self._wrapping:
            engine.runner.execute = self._wrapped

    def _wrapped(self, out, block_tables):
        from torch.profiler import ProfilerActivity, profile

        if self.step == self.start:
            sync(self.engine.device)
            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])  # as latency.py
            self._prof.__enter__()
        result = self._execute(out, block_tables)
        self.step += 1
        if self._prof is not None and self.profiled_steps < self.count:
            self.profiled_steps += 1
            self.decodes += sum(1 for s in out.scheduled if s.num_new_tokens == 1)
            if self.profiled_steps == self.count:
                self._stop()
        return result

    def _stop(self) -> None:
        sync(self.engine.device)
        self._prof.__exit__(None, None, None)

    def result(self) -> dict:
        if self._wrapping:
            del self.engine.runner.execute  # the class's method again
        if self.engine.device.type != "cuda":
            return {"decode_attention_ms_per_step": None, "note": "n/a on CPU (the attention path is plain PyTorch)"}
        if self._prof is None:
            return {"decode_attention_ms_per_step": None, "note": f"the run had fewer than {self.start + 1} steps"}
        if self.profiled_steps < self.count:
            self._stop()
        from torch.autograd import DeviceType

        kernels = [e for e in self._prof.events() if e.device_type == DeviceType.CUDA and self.pattern.search(e.name)]
        total_us = sum(e.time_range.end - e.time_range.start for e in kernels)
        return {
            "decode_attention_ms_per_step": total_us / 1e3 / self.profiled_steps,
            "profiled_steps": self.profiled_steps,
            "decodes_per_profiled_step": self.decodes / self.profiled_steps,
            "kernels": sorted({e.name for e in kernels}),
        }


# -- runs -----------------------------------------------------------------------------------------


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(
        device=args.device, dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
    )
    return {k: v for k, v in kwargs.items() if v is not None}


def make_engine(model: str, mode: str, args: argparse.Namespace) -> MMEngine:
    extra: dict = {"enable_prefix_grouping": mode.startswith("grouped")}
    if HAS_CASCADE:
        extra["cascade_attention"] = mode.partition("=")[2] or "off"
    return MMEngine(model, **engine_kwargs(args), **extra)


def run_mode(engine: MMEngine, mode: str, prompts: list[Prompt], args: argparse.Namespace, words: list[str]) -> dict:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # Warm-up on unrelated text: the first launches (kernel compiles, allocator) are not timed.
    rng = random.Random(-1)
    warm = ["".join(" " + rng.choice(words) for _ in range(args.shared_len + args.unique_len - 1)) for _ in range(2)]
    engine.generate(warm, sampling_params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    ordered = sorted(prompts, key=lambda p: p.text) if mode == "sorted" else prompts
    timings = []
    for repeat in range(args.repeats):  # each from empty caches; the work is the same every time
        engine.reset_prefix_cache()
        engine.reset_encoder_cache()
        before = engine.stats()
        profiler = AttentionProfiler(engine, args.profile_start, args.profile_steps, args.attention_kernels) if not repeat else None
        sync(engine.device)
        start = time.perf_counter()
        outputs = engine.generate([p.text for p in ordered], images=[p.images for p in ordered], sampling_params=params,
                                  use_tqdm=False)
        sync(engine.device)
        timings.append(time.perf_counter() - start)
        if profiler is not None:
            attention = profiler.result()
    elapsed = min(timings)
    stats = engine.stats()
    delta = {k: stats[k] - before[k] for k in stats if k in before and isinstance(stats[k], int)}
    token_ids = [o.prompt_token_ids for o in outputs]
    if any(len(ids) != args.shared_len + args.unique_len for ids in token_ids):
        raise SystemExit(f"prompt lengths are not exactly {args.shared_len} + {args.unique_len} tokens")
    minimum = args.groups * args.shared_len + len(prompts) * args.unique_len  # each prefix once, every suffix
    arrival_index = {id(p): i for i, p in enumerate(prompts)}
    by_arrival = sorted(zip(ordered, outputs), key=lambda po: arrival_index[id(po[0])])
    result = {
        "mode": mode,
        "elapsed_s": elapsed,  # the fastest of --repeats runs
        "elapsed_all_s": timings,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": sum(len(o.token_ids) for o in outputs) / elapsed,
        "prompt_tokens": sum(map(len, token_ids)),
        "prefill_tokens_computed": delta["prefill_tokens_computed"],
        "prefill_tokens_minimum": minimum,
        "prefill_over_minimum": delta["prefill_tokens_computed"] / minimum,
        "steps": delta["steps"],
        "preemptions": delta["num_preemptions"],
        "kv_blocks_evicted": delta["kv_blocks_evicted"],
        "shared_tokens_planned": delta.get("prefix_group_shared_tokens_planned", 0),
        "shared_tokens_achieved": delta.get("prefix_group_shared_tokens_achieved", 0),
        "kv_blocks_total": stats["kv_blocks_total"],
        **attention,
        "outputs": [o.token_ids for _, o in by_arrival] if args.keep_outputs else None,  # in arrival order
    }
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny model)")
    source.add_argument("--build-7b", metavar="DIR", default=None,
                        help="use the LLaVA-1.5-7B-shaped random checkpoint in DIR, building it there if missing")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--degree", type=int, default=8, help="prompts per group (the sharing degree)")
    parser.add_argument("--shared-len", type=int, default=64, help="tokens every prompt of a group shares (BOS included)")
    parser.add_argument("--unique-len", type=int, default=16, help="tokens each prompt adds")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--images", type=int, default=0, help="pictures inside each group's shared part")
    parser.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--modes", default="arrival,sorted,grouped,grouped+cascade",
                        help="comma-separated, from arrival, sorted, grouped, grouped+cascade")
    parser.add_argument("--cascade", default="on", help="comma-separated cascade_attention values for grouped+cascade")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per mode (from empty caches); the fastest counts")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="cap the KV cache (default: sized from memory)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt + output, rounded up")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--profile-start", type=int, default=20, help="first step profiled for decode attention (GPU)")
    parser.add_argument("--profile-steps", type=int, default=10, help="steps profiled; 0 disables the profiler")
    parser.add_argument("--attention-kernels", default=r"decode|cascade",
                        help="regex over kernel names counted as decode attention")
    parser.add_argument("--keep-outputs", action="store_true", help="put every mode's output tokens in the JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/shared_prefix.json")
    args = parser.parse_args(argv)
    for name in ("groups", "degree", "shared_len", "output_len", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.unique_len < 0 or args.images < 0:
        parser.error("--unique-len and --images must be >= 0")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(BASE_MODES) - {"grouped+cascade"})
    if unknown or not modes:
        parser.error(f"--modes: expected some of arrival, sorted, grouped, grouped+cascade, got {args.modes!r}")
    args.mode_list = modes
    if args.max_model_len is None:
        args.max_model_len = -(-(args.shared_len + args.unique_len + args.output_len + 1) // 256) * 256
    return args


def resolve_model(args: argparse.Namespace) -> tuple[str, dict]:
    if args.model:
        return args.model, {}
    if args.build_7b:
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        path, seconds = ensure_checkpoint(Path(args.build_7b), LLAVA_1_5_7B_SPEC, device, "bfloat16")
        return str(path), {"build_s": seconds, "spec": "LLAVA_1_5_7B_SPEC"}
    return str(tiny_llava_path(TinyLlavaSpec())), {"spec": "TinyLlavaSpec()"}


def expand_modes(args: argparse.Namespace) -> list[str]:
    modes = []
    for mode in args.mode_list:
        if mode != "grouped+cascade":
            modes.append(mode)
        elif not HAS_CASCADE:
            print("note: grouped+cascade skipped: this EngineConfig has no cascade_attention option yet")
        else:
            modes += [f"grouped+cascade={value.strip()}" for value in args.cascade.split(",") if value.strip()]
    return modes


def prepare_workload(engine: MMEngine, args: argparse.Namespace) -> tuple[list[Prompt], list[str]]:
    image_marker = getattr(engine.input_processor, "image_token", "<image>")
    words = single_token_words(engine.tokenizer)
    image_tokens = tokens_per_image(engine, image_marker) if args.images else 0
    prompts = build_workload(args, words, image_tokens, image_marker)
    check_lengths(engine.tokenizer, prompts, image_tokens, args.shared_len + args.unique_len)
    return prompts, words


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model, origin = resolve_model(args)
    result: dict = {
        "model": model, "checkpoint": origin,
        "settings": {k: v for k, v in vars(args).items() if k != "mode_list"},
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "cascade_option": HAS_CASCADE,
        "modes": {},
    }
    prompts: list[Prompt] | None = None
    for mode in expand_modes(args):
        engine = make_engine(model, mode, args)
        if prompts is None:  # built with the first engine's tokenizer (the same checkpoint for every mode)
            prompts, words = prepare_workload(engine, args)
            result["device"], result["dtype"] = str(engine.device), str(engine.dtype).removeprefix("torch.")
            print(f"{model} on {result['device']} in {result['dtype']}: {args.groups} groups x {args.degree} prompts, "
                  f"{args.shared_len} shared (with {args.images} image(s)) + {args.unique_len} unique tokens, "
                  f"{args.output_len} out, {'shuffled' if args.shuffle else 'in group order'}")
            print(f"{'mode':<22} {'req/s':>8} {'out tok/s':>10} {'prefill':>9} {'minimum':>8} {'x min':>6} {'steps':>6} "
                  f"{'preempt':>7} {'decode attn ms/step':>20}")
        row = run_mode(engine, mode, prompts, args, words)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result["modes"][mode] = row
        attn = row["decode_attention_ms_per_step"]
        print(f"{mode:<22} {row['requests_per_s']:>8.2f} {row['output_tokens_per_s']:>10.1f} "
              f"{row['prefill_tokens_computed']:>9d} {row['prefill_tokens_minimum']:>8d} {row['prefill_over_minimum']:>6.2f} "
              f"{row['steps']:>6d} {row['preemptions']:>7d} {('n/a' if attn is None else f'{attn:.3f}'):>20}")
    base = result["modes"].get("arrival")
    if base:
        for row in result["modes"].values():
            row["speedup_over_arrival"] = row["requests_per_s"] / base["requests_per_s"]
        print("speedup over arrival order: " + ", ".join(f"{m} {r['speedup_over_arrival']:.2f}x" for m, r in result["modes"].items()))
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
