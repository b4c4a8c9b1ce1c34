"""Request preprocessing (decode, hash, resize and normalize, tokenize) when images repeat.

Each request carries one encoded JPEG (default 1024x768, as photos arrive) chosen among a few
unique pictures, for a LLaVA-1.5-sized processor (336 px, 576 placeholders). Times mmengine's
input processing (what `MMEngine.add_request` runs before queueing) against the plain Hugging Face processor call per
request (what transformers users, and mmengine before its processor cache, pay every time), with
the requests all queued (an offline batch) or arriving one at a time (each done before the next).
Prints milliseconds per request and writes JSON.

    python benchmarks/preprocessing.py
    python benchmarks/preprocessing.py --num-requests 400 --unique-images 4 --width 2048 --height 1536
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import time
from pathlib import Path

from PIL import Image
from transformers import AutoProcessor

from mmengine import MMEngine, SamplingParams
from mmengine.testing import TinyLlavaSpec, make_test_image, tiny_llava_path

PROMPT = "USER: <image>\nDescribe the picture in detail. ASSISTANT:"


def jpeg(seed: int, width: int, height: int) -> bytes:
    buf = io.BytesIO()
    make_test_image(seed, size=(width, height)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: a tiny LLaVA with a 336 px CLIP processor)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--unique-images", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--output", default="benchmarks/results/preprocessing.json")
    args = parser.parse_args()

    model = args.model or str(tiny_llava_path(TinyLlavaSpec(image_size=336, patch_size=14)))
    pictures = [jpeg(seed, args.width, args.height) for seed in range(args.unique_images)]
    workload = [pictures[i % len(pictures)] for i in range(args.num_requests)]
    params = SamplingParams(max_tokens=1)

    hf = AutoProcessor.from_pretrained(model)
    start = time.perf_counter()
    for data in workload:
        hf(text=PROMPT, images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    hf_ms = (time.perf_counter() - start) * 1e3 / len(workload)

    rows = {}
    for label, cache_bytes in (("processor cache on", 1 << 30), ("processor cache off", 0)):
        for mode in ("queued", "one at a time"):
            engine = MMEngine(model, max_model_len=2048, mm_processor_cache_bytes=cache_bytes)
            kept = []
            start = time.perf_counter()
            for data in workload:
                # queued: an offline batch, every request alive at once (live requests share pixels even
                # without the cache); one at a time: each finished and dropped before the next arrives.
                processed = engine.input_processor.process(PROMPT, [data], params)
                if mode == "queued":
                    kept.append(processed)
            ms = (time.perf_counter() - start) * 1e3 / len(workload)
            stats = engine.stats()
            rows[f"{label}, {mode}"] = {"ms_per_request": ms, "speedup_vs_hf": hf_ms / ms,
                                        "images_decoded": stats["images_decoded"],
                                        "images_preprocessed": stats["images_preprocessed"]}

    print(f"{args.num_requests} requests, {args.unique_images} unique {args.width}x{args.height} JPEGs, "
          f"{platform.processor() or platform.machine()}")
    print(f"  {'HF processor per request:':<40} {hf_ms:7.2f} ms/request  (decodes and preprocesses {args.num_requests})")
    for label, r in rows.items():
        print(f"  {label + ':':<40} {r['ms_per_request']:7.2f} ms/request  {r['speedup_vs_hf']:5.1f}x  "
              f"(decoded {r['images_decoded']}, preprocessed {r['images_preprocessed']})")
    out = {"args": vars(args), "hf_ms_per_request": hf_ms, "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
