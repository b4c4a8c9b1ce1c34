"""Image preprocessing per photo: transformers' PIL image processors against mmengine's exact fast path
(multimodal/fast_image_processor.py, the same pixel values bit for bit), one core, for each family's
processor as its published checkpoints configure it, on 1920x1080 JPEG photos and a 4000x3000 one.

    python benchmarks/preprocess.py
    python benchmarks/preprocess.py --photos 24 --output benchmarks/results/preprocess.json

Per family and photo size: milliseconds per photo (median) and photos/s of the processor alone
(decoded pictures in, tensors out), and of the whole intake path (JPEG bytes decoded, then the
processor; the engine decodes with its load_image). The pixel values are checked equal on every photo.
Printed as a table and written as JSON. (A process pool for preprocessing is not built yet: its columns
come with it.)
"""

from __future__ import annotations

import argparse
import io
import json
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=12, help="distinct 1920x1080 photos (and a third as many 4000x3000)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the photos; the best median counts")
    parser.add_argument("--families", nargs="*", help="substrings of the family names to run (default: all)")
    parser.add_argument("--output", default="benchmarks/results/preprocess.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # per core
    families = {name: make for name, make in _families().items()
                if not args.families or any(part in name for part in args.families)}
    sizes = {"1920x1080": [photo_jpeg(seed, 1920, 1080) for seed in range(args.photos)],
             "4000x3000": [photo_jpeg(1000 + seed, 4000, 3000) for seed in range(max(1, args.photos // 3))]}
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
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    print(f"wrote {output}")
    return results


if __name__ == "__main__":
    main()
