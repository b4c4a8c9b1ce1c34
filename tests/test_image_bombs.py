"""Images that pass max_image_pixels but would blow up in preprocessing (a 1xN PNG that a
shortest-edge resize turns into millions of pixels) are refused before the processor runs, with
ImageTooLargeError naming the size they would become; nothing else is harmed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from PIL import Image

from mmengine import MMEngine, SamplingParams
from mmengine.errors import ImageTooLargeError
from mmengine.testing import make_test_image

PROMPT = "USER: <image>\nWhat is shown? ASSISTANT:"
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

# Runs in a child process: the engine is built first, then the address space is capped at what it
# uses plus 1 GiB, so a bomb that reached the resize would end in MemoryError, not in our error.
_CHILD = textwrap.dedent(
    """
    import io, json, resource, sys, time
    from PIL import Image
    from mmengine import MMEngine, SamplingParams
    from mmengine.errors import ImageTooLargeError
    from mmengine.testing import make_test_image

    prompt = "USER: <image>\\nWhat is shown? ASSISTANT:"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = MMEngine(sys.argv[1], max_model_len=128)
    in_flight = engine.add_request(prompt, [make_test_image(1)], params)
    engine.step()

    vm_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm_kib * 1024 + (1 << 30), resource.RLIM_INFINITY))

    def png(width, height):
        buf = io.BytesIO()
        Image.new("RGB", (width, height)).save(buf, "PNG")
        return buf.getvalue()

    report = {"refused": [], "seconds": []}
    for width, height in [(1, 5000), (1, 200000), (200000, 1)]:
        data = png(width, height)
        start = time.perf_counter()
        try:
            engine.add_request(prompt, [data], params)
            report["refused"].append(None)
        except ImageTooLargeError as err:
            report["refused"].append([len(data), str(err)])
        report["seconds"].append(time.perf_counter() - start)
    nxt = engine.add_request(prompt, [make_test_image(2)], params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    report["in_flight"], report["next"] = outputs[in_flight], outputs[nxt]
    print(json.dumps(report))
    """
)


def test_thin_png_bombs_are_refused_under_an_address_space_limit(checkpoint_dir):
    path = checkpoint_dir()
    result = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    refused = report["refused"]
    assert all(r is not None for r in refused), refused
    size_5000, message_5000 = refused[0]
    assert size_5000 < 200  # a tiny file
    # the tiny checkpoint's processor resizes the shortest edge to 32: 1x5000 would become 32x160000
    assert "1x5000" in message_5000 and "32x160000" in message_5000 and "aspect ratio" in message_5000
    assert "32x6400000" in refused[1][1] and "6400000x32" in refused[2][1]
    print("seconds per refusal:", report["seconds"])  # shown with -s; never asserted (CI timing varies)

    engine = MMEngine(str(path), max_model_len=128)
    expected = engine.generate([PROMPT, PROMPT], images=[[make_test_image(1)], [make_test_image(2)]], sampling_params=PARAMS, use_tqdm=False)
    assert [report["in_flight"], report["next"]] == [o.token_ids for o in expected]


def test_an_upscale_past_max_image_pixels_is_refused_naming_the_size(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=128, max_image_pixels=4096)
    small_but_upscaled = Image.new("RGB", (10, 100))  # 1000 pixels, resized to 32x320 = 10240
    with pytest.raises(ImageTooLargeError, match=r"image 1: the processor would resize this 10x100 image to 32x320 = 10240 pixels"):
        engine.generate("USER: <image> <image> ASSISTANT:", images=[make_test_image(3), small_but_upscaled], use_tqdm=False)
    assert not engine.has_unfinished_requests()  # nothing was queued
    (out,) = engine.generate(PROMPT, images=[Image.new("RGB", (64, 64))], sampling_params=PARAMS, use_tqdm=False)
    assert len(out.token_ids) == 4


def test_the_resize_rule_is_the_processors(checkpoint_dir):
    """The predicted size is what the processor really produces before its center crop."""
    from mmengine.multimodal.resize_guard import resized_size

    processor = MMEngine(str(checkpoint_dir()), max_model_len=128).input_processor.hf_processor.image_processor
    for width, height in [(48, 40), (7, 300), (300, 7), (33, 32), (1000, 999)]:
        # The whole preprocessing without its crop: the same call whichever backend (PIL or
        # torchvision) the processor uses.
        pixels = processor(images=Image.new("RGB", (width, height)), do_center_crop=False, return_tensors="pt")["pixel_values"]
        assert resized_size(processor, height, width) == tuple(pixels.shape[-2:])
