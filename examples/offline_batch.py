"""Offline batch over a checkpoint directory: many prompts, repeated images, outputs in input order.

    python examples/offline_batch.py                       # built-in tiny model (random weights)
    python examples/offline_batch.py --model /models/llava-1.5-7b-hf --images a.jpg b.jpg
"""

from __future__ import annotations

import argparse

from mmengine import MMEngine, SamplingParams
from mmengine.testing import make_test_image, tiny_llava_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--images", nargs="*", default=None, help="image files (default: generated pictures)")
    args = parser.parse_args()

    model = args.model or str(tiny_llava_path())
    images = args.images or [make_test_image(seed) for seed in range(3)]
    questions = ["What is shown?", "What colours dominate?", "Write a one-line caption."]
    prompts = [f"USER: <image>\n{q} ASSISTANT:" for q in questions for _ in images]
    image_lists = [[img] for _ in questions for img in images]

    engine = MMEngine(model)
    outputs = engine.generate(prompts, images=image_lists, sampling_params=SamplingParams(max_tokens=32, temperature=0))
    for output in outputs:
        print(f"{output.request_id}: {output.text!r} ({output.finish_reason})")
    print(engine.stats())


if __name__ == "__main__":
    main()
