"""Image preprocessing per photo: transformers' PIL image processors against mmengine's exact fast path
(multimodal/fast_image_processor.py, the same pixel values bit for bit), one core, for each family's
processor as its published checkpoints configure it, on 1920x1080 JPEG photos and a 4000x3000 one (--sizes).

    python benchmarks/preprocess.py
    python benchmarks/preprocess.py --photos 24 --output benchmarks/results/preprocess.json

Per family and photo size: milliseconds per photo (median) and photos/s of the processor alone
(decoded pictures in, tensors out), and of the whole intake path (JPEG bytes decoded, then the
processor; the engine decodes with its load_image). The pixel values are checked equal on every photo.

Then, for Qwen2.5-VL's processor (a micro checkpoint with max_pixels 1003520): photos/s of the
preprocessing pool (mm_processor_workers, JPEG bytes in, shared-memory tensors out) at each --workers
count, and the whole engine (`generate()`, one token) on --photos new 1920x1080 photos (the first --sizes) without and with
workers, against transformers' processor alone on the same photos. The engine runs on --engine-threads torch threads (default:
the process's own, one per core, as an engine user gets them; the processors' rows are per core), and its wall time is broken
down: the vision tower's encodes (ms per photo, beside the processor's), the rest of its steps (the decoder, sampling), and the
time it had nothing to step (waiting for the first pictures); with the CPU seconds of the engine's process and of its workers,
whose sum over the cores bounds the time from below however the work were spread, against the processor's own CPU seconds (a
ratio that other load on the machine does not move, as it moves wall times). Printed as tables, written as JSON.

With --encoder-model (a Qwen2.5-VL checkpoint, e.g. the GPU suite's 7B shape) and --device cuda: the vision
encoder's photos/s on the same photos (prepared beforehand, batches of --encoder-batch), beside the front
end's (the pool's photos/s at the largest --workers count), so a GPU run shows which side is the bottleneck.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

def _families() -> dict[str, Callable[[], object]]:
    """Each family's processor as its published checkpoints configure it (preprocessor_config.json)."""
    from transformers import CLIPImageProcessorPil, Gemma4ImageProcessorPil, Qwen2VLImageProcessorPil, SiglipImageProcessorPil

    return {
        "qwen2.5-vl (max_pixels 1003520)": lambda: Qwen2VLImageProcessorPil(max_pixels=1003520),
        "qwen3-vl / qwen3.5 (patch 16)": lambda: Qwen2VLImageProcessorPil(patch_size=16, min_pixels=65536, max_pixels=1003520),
        "gemma4 (280 soft tokens)": lambda: Gemma4ImageProcessorPil(),
        "llava-1.5 (CLIP 336, crop)": lambda: CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
        "siglip 384": lambda: SiglipImageProcessorPil(size={"height": 384, "width": 384}),
    }


def photo_jpeg(seed: int, width: int, height: int) -> bytes:
    """A smooth, photo-like JPEG (noise upsampled: JPEG and the resize work as on a photograph)."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (max(height // 8, 1), max(width // 8, 1), 3), dtype=np.uint8))
    buffer = io.BytesIO()
    small.resize((width, height), Image.BICUBIC).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _median_ms(run: Callable[[object], object], inputs: list) -> float:
    times = []
    for item in inputs:
        start = time.perf_counter()
        run(item)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(make_processor: Callable[[], object], jpegs: list[bytes], repeats: int) -> dict:
    from mmengine.multimodal.fast_image_processor import fast_image_processor
    from mmengine.multimodal.image_loading import load_image

    processor = make_processor()
    fast, why = fast_image_processor(processor)
    if fast is None:
        return {"fast_path": None, "why": why}
    pictures = [load_image(data) for data in jpegs]
    for picture in pictures:  # exactness on every photo measured
        reference, got = processor(images=[picture], return_tensors="pt"), fast([picture])
        if not all(torch.equal(reference[key], got[key]) for key in reference):
            raise AssertionError(f"{type(processor).__name__}: the fast path's pixels differ from transformers'")

    def engine(picture: Image.Image) -> object:
        return fast([picture])

    def hf(picture: Image.Image) -> object:
        return processor(images=[picture], return_tensors="pt")

    def hf_intake(data: bytes) -> object:
        return processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")

    def engine_intake(data: bytes) -> object:
        return fast([load_image(data)])

    rows = {}
    for label, run, inputs in (("transformers", hf, pictures), ("mmengine", engine, pictures),
                               ("transformers, decode + processor", hf_intake, jpegs),
                               ("mmengine, decode + processor", engine_intake, jpegs)):
        run(inputs[0])  # warm
        ms = min(_median_ms(run, inputs) for _ in range(repeats))
        rows[label] = {"ms_per_photo": round(ms, 2), "photos_per_s": round(1e3 / ms, 1)}
    rows["speedup_processor"] = round(rows["transformers"]["ms_per_photo"] / rows["mmengine"]["ms_per_photo"], 2)
    rows["speedup_intake"] = round(rows["transformers, decode + processor"]["ms_per_photo"]
                                   / rows["mmengine, decode + processor"]["ms_per_photo"], 2)
    return {"fast_path": why, **rows}


QWEN_OVERRIDES = {"max_pixels": 1003520}


class EngineClock:
    """Where generate()'s wall time goes, from timers around the engine's own methods: its steps, and within them
    the vision tower's encodes."""

    def __init__(self, engine: object) -> None:
        self.seconds = {"steps": 0.0, "encode": 0.0}
        self.encoded = 0
        steps, runner = engine.steps, engine.runner  # type: ignore[attr-defined]
        advance, run_encoder, encode_items = steps.advance, runner._run_encoder, runner.model.encode_items
        steps.advance = self._timed("steps", advance)
        runner._run_encoder = self._timed("encode", run_encoder)

        def counted(items: list) -> object:
            self.encoded += len(items)
            return encode_items(items)

        runner.model.encode_items = counted

    def _timed(self, name: str, method: Callable) -> Callable:
        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.encoded = 0

    def breakdown(self, seconds: float, photos: int, hf_seconds: float) -> dict:
        """generate()'s `seconds` on `photos` pictures, split: the tower, the rest of the steps, no step to run."""
        encode, steps = self.seconds["encode"], self.seconds["steps"]
        tower_ms = 1e3 * encode / max(self.encoded, 1)
        return {"encode_s": round(encode, 3), "other_step_s": round(steps - encode, 3), "idle_s": round(seconds - steps, 3),
                "tower_ms_per_photo": round(tower_ms, 1), "tower_of_processor": round(tower_ms / (1e3 * hf_seconds / photos), 2),
                "photos_encoded": self.encoded}


def pool_and_engine(jpegs: list[bytes], worker_counts: list[int], size: str = "1920x1080", engine_threads: int = 1) -> dict:
    """The pool's photos/s at each size, and generate() on the photos with and without workers, against
    transformers' processor alone on them (Qwen2.5-VL's processor, a micro checkpoint), the engine on `engine_threads`
    torch threads."""
    from mmengine import SamplingParams
    from mmengine.models.registry import load_hf_processor
    from mmengine.testing.qwen_vl import qwen_vl_prompt, tiny_qwen_vl_path, tiny_spec

    path = tiny_qwen_vl_path(tiny_spec("qwen2_5_vl"))
    width, height = (int(n) for n in size.split("x"))
    processor = load_hf_processor(path, QWEN_OVERRIDES).image_processor
    start, cpu = time.perf_counter(), time.process_time()
    for data in jpegs:
        processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    hf_seconds, hf_cpu = time.perf_counter() - start, time.process_time() - cpu
    out: dict = {"photos": len(jpegs), "transformers_processor_s": round(hf_seconds, 3), "transformers_processor_cpu_s": hf_cpu,
                 "transformers_photos_per_s": round(len(jpegs) / hf_seconds, 1), "workers": {}, "engine": {}}
    print(f"\nQwen2.5-VL processor on {len(jpegs)} new {size} photos: transformers alone {hf_seconds:.2f} s "
          f"({len(jpegs) / hf_seconds:.1f} photos/s)")
    prompt, params = qwen_vl_prompt("What is in this photo?", 1), SamplingParams(max_tokens=1, temperature=0)
    processor_threads, out["engine_threads"] = torch.get_num_threads(), engine_threads
    torch.set_num_threads(engine_threads)
    try:
        for count in sorted({0, *worker_counts}):  # one engine (and pool) per count: the pool timed alone, then generate()
            out["engine"][count] = _time_engine(path, count, count in worker_counts, jpegs, (width, height), prompt, params,
                                                hf_seconds, out)
    finally:
        torch.set_num_threads(processor_threads)
    return out


def _time_engine(path: Path, count: int, time_pool: bool, jpegs: list[bytes], size: tuple[int, int], prompt: str,
                 params: object, hf_seconds: float, out: dict) -> dict:
    """generate() on the photos with `count` workers (and the pool alone first, if `time_pool`), broken down."""
    from concurrent.futures import ThreadPoolExecutor

    from mmengine import MMEngine
    from mmengine.multimodal.preprocess_pool import PreprocessPool

    width, height = size
    with MMEngine(str(path), device="cpu", dtype="float32", max_model_len=4096, mm_processor_kwargs=QWEN_OVERRIDES,
                  mm_processor_workers=count, mm_processor_cache_bytes=0, enable_prefix_caching=False) as engine:
        if time_pool:
            pool: PreprocessPool = engine.input_processor.pool
            pool.prepare(photo_jpeg(99, width, height), 0)  # the workers are up
            with ThreadPoolExecutor(count) as threads:
                start = time.perf_counter()
                list(threads.map(lambda data: pool.prepare(data, 0), jpegs))
                seconds = time.perf_counter() - start
            out["workers"][count] = {"photos_per_s": round(len(jpegs) / seconds, 1)}
            print(f"  pool of {count}: {len(jpegs) / seconds:.1f} photos/s (JPEG bytes in, tensors in shared memory out)")
        clock = EngineClock(engine)
        engine.generate(prompt, images=[photo_jpeg(98, width, height)], sampling_params=params, use_tqdm=False)  # warm
        clock.reset()
        workers = _processes(engine.input_processor.pool.worker_pids() if count else [])
        cpu = _cpu_seconds(workers)
        start = time.perf_counter()
        engine.generate([prompt] * len(jpegs), images=[[data] for data in jpegs], sampling_params=params, use_tqdm=False)
        seconds = time.perf_counter() - start
        engine_cpu, workers_cpu = (after - before for after, before in zip(_cpu_seconds(workers), cpu))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    row = {"seconds": round(seconds, 3), "of_transformers_processor": round(seconds / hf_seconds, 2),
           **clock.breakdown(seconds, len(jpegs), hf_seconds), "engine_process_cpu_s": round(engine_cpu, 3),
           "workers_cpu_s": round(workers_cpu, 3), "cores": cores,
           "cpu_bound_of_transformers_processor": round((engine_cpu + workers_cpu) / cores / max(out["transformers_processor_cpu_s"], 1e-9), 2)}
    print(f"  generate() with mm_processor_workers={count}: {seconds:.2f} s = {seconds / hf_seconds:.2f}x "
          f"transformers' processor alone; vision tower {row['encode_s']:.2f} s ({row['tower_ms_per_photo']:.0f} ms/photo = "
          f"{row['tower_of_processor']:.2f}x the processor's), rest of the steps {row['other_step_s']:.2f} s, "
          f"nothing to step {row['idle_s']:.2f} s\n    CPU: engine process {engine_cpu:.2f} s, workers {workers_cpu:.2f} s: "
          f"on {cores} cores at best {row['cpu_bound_of_transformers_processor']:.2f}x transformers' processor's CPU time")
    return row


def _processes(pids: list[int]) -> list:
    import psutil

    return [psutil.Process(pid) for pid in pids]


def _cpu_seconds(workers: list) -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of the workers so far."""
    return time.process_time(), sum(sum(worker.cpu_times()[:2]) for worker in workers)


def encoder_rate(model: str, jpegs: list[bytes], device: str, batch: int) -> dict:
    """The vision encoder's photos/s on the photos (their items prepared beforehand), in batches of `batch`; and
    again with transformers' own attention in the tower (one SDPA call per image or window, where the engine's
    packed attention makes one per distinct length: layers/packed_vision_attention.py), the same outputs."""
    from mmengine import MMEngine, SamplingParams
    from mmengine.layers.packed_vision_attention import PACKED_ATTENTION
    from mmengine.testing.qwen_vl import qwen_vl_prompt

    dtype = "bfloat16" if device == "cuda" else "float32"
    with MMEngine(model, device=device, dtype=dtype, max_model_len=4096, mm_processor_kwargs=QWEN_OVERRIDES,
                  mm_processor_cache_bytes=0, enforce_eager=True) as engine:
        prompt = qwen_vl_prompt("What is in this photo?", 1)
        items = [engine.input_processor.process(prompt, [data], SamplingParams()).mm_items[0] for data in jpegs]
        inputs = [{name: tensor.to(device) for name, tensor in item.encoder_inputs.items()} for item in items]
        encode = engine.runner.model.encode_items
        tower_config = engine.runner.model.visual.config  # the tower's own copy, shared by its layers

        def seconds_for_all() -> float:
            with torch.inference_mode():
                for run in range(2):  # the first warms kernels and cuDNN plans
                    start = time.perf_counter()
                    for first in range(0, len(inputs), batch):
                        encode(inputs[first:first + batch])
                    if device == "cuda":
                        torch.cuda.synchronize()
            return time.perf_counter() - start

        packed = seconds_for_all()
        tower_config._attn_implementation = "sdpa"
        try:
            per_sequence = seconds_for_all()
        finally:
            tower_config._attn_implementation = PACKED_ATTENTION
    out = {"photos_per_s": round(len(jpegs) / packed, 1), "batch": batch, "device": device, "dtype": dtype,
           "embeddings_per_photo": round(sum(item.length for item in items) / len(items), 1),
           "photos_per_s_transformers_attention": round(len(jpegs) / per_sequence, 1),
           "packed_attention_speedup": round(per_sequence / packed, 2)}
    print(f"  vision encoder ({device}, {dtype}, batches of {batch}): {out['photos_per_s']:.1f} photos/s; with "
          f"transformers' attention (a call per window): {out['photos_per_s_transformers_attention']:.1f} "
          f"({out['packed_attention_speedup']:.2f}x)")
    return out


def _photo_sizes(text: str) -> list[tuple[int, int]]:
    try:
        sizes = [tuple(int(n) for n in size.split("x")) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(size) != 2 or min(size) < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"expected WxH[,WxH...] with positive sizes, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=12, help="distinct photos of the first size (a third as many of the others)")
    parser.add_argument("--sizes", type=_photo_sizes, default=_photo_sizes("1920x1080,4000x3000"),
                        help="photo sizes WxH, comma-separated; the pool, generate() and the encoder run on the first")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the photos; the best median counts")
    parser.add_argument("--families", nargs="*", help="substrings of the family names to run (default: all; `none` skips the table)")
    parser.add_argument("--workers", default="1,2", help="preprocessing pool sizes to time (comma-separated; empty: none)")
    parser.add_argument("--engine-threads", type=int, default=torch.get_num_threads(),
                        help="torch threads of the engine's process for generate() (default: the process's own)")
    parser.add_argument("--encoder-model", help="a Qwen2.5-VL checkpoint whose vision encoder is timed on the same photos")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="the encoder's device")
    parser.add_argument("--encoder-batch", type=int, default=4)
    parser.add_argument("--output", default="benchmarks/results/preprocess.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # per core
    families = {name: make for name, make in _families().items()
                if not args.families or any(part in name for part in args.families)}
    sizes = {f"{w}x{h}": [photo_jpeg(1000 * i + seed, w, h) for seed in range(args.photos if i == 0 else max(1, args.photos // 3))]
             for i, (w, h) in enumerate(args.sizes)}
    first = next(iter(sizes))
    results: dict = {"machine": platform.platform(), "python": sys.version.split()[0], "torch_threads": 1,
                     "photos": {size: len(jpegs) for size, jpegs in sizes.items()}, "families": {}}
    print(f"{'family':34s} {'photo':10s} {'transformers ms':>16s} {'mmengine ms':>12s} {'x':>6s} "
          f"{'with decode: hf ms':>19s} {'mm ms':>8s} {'x':>6s}")
    for name, make in families.items():
        results["families"][name] = {}
        for size, jpegs in sizes.items():
            row = measure(make, jpegs, args.repeats)
            results["families"][name][size] = row
            if row["fast_path"] is None:
                print(f"{name:34s} {size:10s} no fast path: {row['why']}")
                continue
            print(f"{name:34s} {size:10s} {row['transformers']['ms_per_photo']:16.1f} {row['mmengine']['ms_per_photo']:12.1f} "
                  f"{row['speedup_processor']:6.2f} {row['transformers, decode + processor']['ms_per_photo']:19.1f} "
                  f"{row['mmengine, decode + processor']['ms_per_photo']:8.1f} {row['speedup_intake']:6.2f}")
    workers = [int(n) for n in args.workers.split(",") if n]
    if workers:
        results["pool"] = pool_and_engine(sizes[first], workers, first, max(1, args.engine_threads))
    if args.encoder_model:
        results["encoder"] = encoder_rate(args.encoder_model, sizes[first], args.device, args.encoder_batch)
        if workers:
            front = results["pool"]["workers"][max(workers)]["photos_per_s"]
            results["encoder"]["front_end_photos_per_s"] = front
            results["encoder"]["front_end_over_encoder"] = round(front / results["encoder"]["photos_per_s"], 3)
            print(f"  front end ({max(workers)} workers) / encoder: {results['encoder']['front_end_over_encoder']:.2f}")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    print(f"wrote {output}")
    return results


if __name__ == "__main__":
    main()
