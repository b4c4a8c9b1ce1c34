"""Memory tiers: a workload whose pictures do not fit the device's encoder cache, with the host tier
off and on.

K pictures (K = --working-set x the device tier's capacity in pictures) are each asked about in
--rounds rounds. Each picture comes after its own document (--document-words of text: a prefix no
other picture shares), and the question after the picture differs per round, so every round needs
the document's KV and the picture's embeddings again. Modes: tiers off (the device evicted them:
prefill and encode again), the encoder tier (encoder_cache_host_bytes: embeddings copied back), and
both tiers (plus kv_cache_host_bytes: the document's KV blocks copied back too). Reported per mode:
encoder runs, host-tier hits, prefill tokens, requests/s; and, per picture, the time to copy its
embeddings back against the time to encode it (synchronized, median of --timing-repeats).

    python benchmarks/tiered_cache.py                                  # tiny built-in model on CPU
    python benchmarks/tiered_cache.py --build-7b /tmp/llava-1.5-7b     # LLaVA-1.5-7B shape on a GPU

On CPU the device tiers are kept small (--num-kv-blocks) so that the working set is several times them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import add_model_source, resolve_model, run_record, sync, write_json  # noqa: E402  (a sibling script)

from mmengine import MMEngine, SamplingParams  # noqa: E402
from mmengine.testing import make_test_image  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(parser)
    parser.add_argument("--family", default="llava", choices=["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--working-set", type=float, default=5.0, help="pictures as a multiple of the device tier")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--document-words", type=int, default=48, help="text before each picture, its own per picture")
    parser.add_argument("--image-size", type=int, default=336)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: 4 on CPU, sized from memory on a GPU")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="also bounds the device encoder tier")
    parser.add_argument("--timing-repeats", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/tiered_cache.json")
    args = parser.parse_args(argv)
    if args.working_set <= 1 or args.rounds < 2:
        parser.error("--working-set must exceed 1 and --rounds must be at least 2")
    return args


def _engine(model: str, args: argparse.Namespace, encoder_host_bytes: int, kv_host_bytes: int = 0) -> MMEngine:
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    blocks = args.num_kv_blocks if args.num_kv_blocks is not None else (24 if on_cpu else None)
    batched = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    return MMEngine(model, device=args.device, max_model_len=args.max_model_len, num_kv_blocks=blocks,
                    encoder_cache_host_bytes=encoder_host_bytes, kv_cache_host_bytes=kv_host_bytes, **batched)


def _prompts(engine: MMEngine, num_pictures: int, rnd: int, document_words: int = 0) -> list[str]:
    words = "the report describes a river a bridge and the boats that pass under it in the morning".split()
    documents = [f"Document {i}: " + " ".join(words[(i + j) % len(words)] for j in range(document_words))
                 for i in range(num_pictures)]
    return [engine.input_processor.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": documents[i]}, {"type": "image"}, {"type": "text", "text": f"Round {rnd}: what is in it?"}]}])
        for i in range(num_pictures)]


def run_mode(engine: MMEngine, pictures: list, args: argparse.Namespace) -> dict:
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    start, before = time.perf_counter(), engine.stats()
    for rnd in range(args.rounds):
        engine.generate(_prompts(engine, len(pictures), rnd, args.document_words), images=[[p] for p in pictures],
                        sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    delta = {name: after[name] - before[name]
             for name in ("encoder_runs", "encoder_host_hits", "prefill_tokens_computed", "kv_host_hits")}
    return {**delta, "elapsed_s": elapsed, "requests_per_s": args.rounds * len(pictures) / elapsed,
            "encoder_host_bytes": after["encoder_host_bytes"], "encoder_cache_evictions": after["encoder_cache_evictions"]}


def per_picture_times(engine: MMEngine, picture, repeats: int) -> dict:
    """The tower's time for one picture against copying its embeddings back from host memory."""
    processed = engine.input_processor.process(_prompts(engine, 1, 0)[0], [picture], SamplingParams(max_tokens=1))
    item = processed.mm_items[0]
    runner = engine.runner
    device = runner.device
    encode, copy = [], []
    with torch.inference_mode():
        (output,) = runner.model.encode_items([item.encoder_inputs])
        host = output.to("cpu")
        if device.type == "cuda":
            host = host.pin_memory()
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            runner.model.encode_items([item.encoder_inputs])
            sync(device)
            encode.append(time.perf_counter() - t)
            t = time.perf_counter()
            host.to(device, non_blocking=True) if device.type == "cuda" else host.clone()
            sync(device)
            copy.append(time.perf_counter() - t)
    return {"embedding_bytes": host.numel() * host.element_size(), "encode_ms": 1e3 * statistics.median(encode),
            "copy_back_ms": 1e3 * statistics.median(copy)}


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    model, origin = resolve_model(args)
    probe = _engine(model, args, 0)
    picture = make_test_image(0, size=(args.image_size, args.image_size))
    tokens = probe.input_processor.process(_prompts(probe, 1, 0)[0], [picture], SamplingParams()).mm_items[0].length
    device_pictures = max(1, probe.encoder_cache.capacity // tokens)
    num_pictures = int(args.working_set * device_pictures)
    pictures = [make_test_image(1 + i, size=(args.image_size, args.image_size)) for i in range(num_pictures)]
    host_bytes = num_pictures * tokens * probe.runner.embedding_bytes
    prompt_tokens = len(probe.input_processor.process(_prompts(probe, 1, 0, args.document_words)[0], [picture],
                                                      SamplingParams()).prompt_token_ids)
    kv_host_bytes = num_pictures * (prompt_tokens // probe.config.cache_config.block_size + 1) * probe.runner.kv_block_bytes
    result = {**run_record(model, origin, args), "device_tier_pictures": device_pictures, "pictures": num_pictures,
              "per_picture": per_picture_times(probe, picture, args.timing_repeats)}
    del probe
    for name, encoder_bytes, kv_bytes in (("tiers_off", 0, 0), ("encoder_tier", host_bytes, 0),
                                          ("both_tiers", host_bytes, kv_host_bytes)):
        result[name] = run_mode(_engine(model, args, encoder_bytes, kv_bytes), pictures, args)
        row = result[name]
        print(f"{name:13s} encoder runs {row['encoder_runs']:5d}, encoder host hits {row['encoder_host_hits']:5d}, KV host "
              f"hits {row['kv_host_hits']:5d} blocks, prefill tokens {row['prefill_tokens_computed']:7d}, "
              f"{row['requests_per_s']:.2f} req/s")
    result["speedup"] = result["both_tiers"]["requests_per_s"] / result["tiers_off"]["requests_per_s"]
    times = result["per_picture"]
    print(f"{num_pictures} pictures, {device_pictures} fit the device tier; per picture: encode {times['encode_ms']:.2f} ms, "
          f"copy back {times['copy_back_ms']:.3f} ms ({times['embedding_bytes']} bytes); speedup {result['speedup']:.2f}x")
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
