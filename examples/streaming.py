"""Driving the engine step by step: requests join while others run, and text arrives token by token.

    python examples/streaming.py [--model PATH]
"""

from __future__ import annotations

import argparse

from mmengine import MMEngine, SamplingParams
from mmengine.testing import make_test_image, tiny_llava_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    engine = MMEngine(args.model or str(tiny_llava_path()))
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=0)
    pending = [("USER: <image>\nDescribe the picture. ASSISTANT:", [make_test_image(1)]),
               ("USER: Tell me a joke. ASSISTANT:", None),
               ("USER: <image>\nWhat stands out? ASSISTANT:", [make_test_image(2)])]
    engine.add_request(*pending.pop(0), sampling_params=params)
    while engine.has_unfinished_requests() or pending:
        if pending:  # a new request joins the running batch every step
            engine.add_request(*pending.pop(0), sampling_params=params)
        for output in engine.step():
            status = f"done ({output.finish_reason})" if output.finished else "..."
            print(f"{output.request_id}: {output.text!r} {status}")


if __name__ == "__main__":
    main()
