"""Grammar engines for structured output, side by side: llguidance and xgrammar (and outlines-core's
index build when installed), on the schemas of mmengine.testing.schemas.

    python benchmarks/grammar_engines.py                   # 32k-token BPE trained on local text
    python benchmarks/grammar_engines.py --vocab 128000 --steps 64

Per engine: the tokenizer set-up (once per engine), each schema's compile time (once per schema: both
engines are used with a cache), and the host time to compute one step's token mask, measured while a
random walk through the grammar takes allowed tokens (what the sampler would do). Masks are host
bitmasks of ceil(vocab/32) int32, the form the sampler applies on the device.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from mmengine.testing.schemas import SCHEMAS


def _corpus(limit_bytes: int = 30_000_000):
    """Text to train a realistic-size BPE on: the standard library's sources (always on disk)."""
    total = 0
    for path in sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"), recursive=True)):
        text = Path(path).read_text(errors="ignore")
        total += len(text)
        yield text
        if total > limit_bytes:
            return


def build_tokenizer(vocab: int, corpus_bytes: int = 30_000_000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Tokens of at most 16 characters, as real vocabularies: code's long runs of '#' or spaces would
    # otherwise merge into tokens of hundreds of bytes.
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"], show_progress=False, max_token_length=16,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(corpus_bytes), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def _walk(first_mask, allowed_after, steps: int, rng: random.Random, eos: int) -> list[float]:
    """Mask times (s) along a random walk: compute the mask, take a random allowed non-EOS token."""
    times = []
    mask = None
    for _ in range(steps):
        start = time.perf_counter()
        mask = first_mask()
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits)
        choices = [int(t) for t in allowed if t != eos] or [eos]
        token = rng.choice(choices)
        if not allowed_after(token) or token == eos:
            break
    return times


def bench_llguidance(tokenizer, steps: int, seed: int) -> dict:
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    setup = time.perf_counter() - start
    compile_s, mask_s = [], []
    words = (len(tokenizer) + 31) // 32
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s.append(time.perf_counter() - start)
        assert not matcher.is_error(), (name, matcher.get_error())
        mask = np.zeros(words, dtype=np.int32)

        def fill():
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            return mask

        mask_s += _walk(fill, matcher.consume_token, steps, random.Random(seed), tokenizer.eos_token_id)
    return {"setup_s": setup, "compile_ms": _ms(compile_s), "mask_us": _us(mask_s)}


def bench_xgrammar(tokenizer, steps: int, seed: int) -> dict:
    import torch
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - start
    compile_s, mask_s = [], []
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_s.append(time.perf_counter() - start)
        bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))

        def fill():
            matcher.fill_next_token_bitmask(bitmask, 0)
            return bitmask[0].numpy()

        mask_s += _walk(fill, matcher.accept_token, steps, random.Random(seed), tokenizer.eos_token_id)
    del torch
    return {"setup_s": setup, "compile_ms": _ms(compile_s), "mask_us": _us(mask_s)}


def _ms(values: list[float]) -> dict:
    return {"median": 1e3 * statistics.median(values), "max": 1e3 * max(values), "total": 1e3 * sum(values)}


def _us(values: list[float]) -> dict:
    values = sorted(values)
    return {"median": 1e6 * statistics.median(values), "p99": 1e6 * values[int(0.99 * (len(values) - 1))],
            "steps": len(values)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=48, help="random-walk steps per schema")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=30_000_000, help="text the BPE is trained on")
    parser.add_argument("--output", default="benchmarks/results/grammar_engines.json")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    tokenizer = build_tokenizer(args.vocab, args.corpus_bytes)
    print(f"tokenizer: {len(tokenizer)} tokens, trained in {time.perf_counter() - start:.1f} s")
    result = {"vocab": len(tokenizer), "schemas": len(SCHEMAS), "engines": {}}
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            numbers = bench(tokenizer, args.steps, args.seed)
        except ImportError as err:
            print(f"{name}: not installed ({err})")
            continue
        result["engines"][name] = numbers
        print(f"{name:11s} set-up {numbers['setup_s']:.2f} s | compile per schema median "
              f"{numbers['compile_ms']['median']:.1f} ms, max {numbers['compile_ms']['max']:.1f} ms | mask per step "
              f"median {numbers['mask_us']['median']:.0f} us, p99 {numbers['mask_us']['p99']:.0f} us "
              f"({numbers['mask_us']['steps']} steps)")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
