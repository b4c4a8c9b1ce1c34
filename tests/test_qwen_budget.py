"""Native-resolution families: the largest item comes from max_pixels (any aspect ratio the engine
accepts), `mmengine budget` and the engine agree on it, and an override of max_pixels moves both."""

from __future__ import annotations

import json
import random

import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from mmengine import MMEngine, SamplingParams
from mmengine.cli import main
from mmengine.errors import ConfigError
from mmengine.models.qwen_resize import max_tokens_for_pixels, smart_resize
from mmengine.multimodal.resize_guard import MAX_IMAGE_ASPECT_RATIO
from mmengine.testing import make_test_image

FACTOR = 28  # patch 14 x merge 2


@pytest.mark.parametrize("min_pixels,max_pixels", [(56 * 56, 28 * 28 * 64), (28 * 28 * 4, 28 * 28 * 16), (56 * 56, 28 * 28 * 1280)])
def test_max_tokens_bounds_every_image_and_is_attained(min_pixels, max_pixels):
    """No image within the aspect-ratio limit makes more tokens than the bound, and some image makes exactly it."""
    bound = max_tokens_for_pixels(min_pixels, max_pixels, FACTOR)
    rng = random.Random(0)
    most = 0
    for _ in range(4000):
        height = rng.randint(1, 3000)
        ratio = rng.uniform(1, MAX_IMAGE_ASPECT_RATIO)
        width = max(1, int(height * ratio)) if rng.random() < 0.5 else max(1, int(height / ratio))
        if max(height, width) / min(height, width) > MAX_IMAGE_ASPECT_RATIO:
            continue
        ours = smart_resize(height, width, FACTOR, min_pixels, max_pixels)
        assert ours == hf_smart_resize(height, width, FACTOR, min_pixels, max_pixels)
        most = max(most, ours[0] * ours[1] // FACTOR**2)
    assert most <= bound
    # Witnesses: a 200:1 strip, and images whose sides are exact multiples of the factor filling max_pixels.
    units = max_pixels // FACTOR**2
    witnesses = [(10, 10 * MAX_IMAGE_ASPECT_RATIO)] + [(FACTOR * a, FACTOR * (units // a)) for a in range(1, 40) if units // a]
    for height, width in witnesses:
        if max(height, width) / min(height, width) <= MAX_IMAGE_ASPECT_RATIO:
            h, w = smart_resize(height, width, FACTOR, min_pixels, max_pixels)
            most = max(most, h * w // FACTOR**2)
    assert most == bound  # the bound is what the processor really produces at worst


@pytest.mark.parametrize("family_name", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("overrides", [None, {"max_pixels": 28 * 28 * 16}])
def test_budget_cli_and_engine_use_the_largest_item_from_max_pixels(family_checkpoint, capsys, family_name, overrides):
    path = family_checkpoint(family_name)
    argv = ["budget", "--model", str(path), "--json", "--device", "cpu", "--num-kv-blocks", "10"]
    if overrides:
        argv += ["--mm-processor-kwargs", ",".join(f"{k}={v}" for k, v in overrides.items())]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    max_pixels = (overrides or {}).get("max_pixels", 28 * 28 * 64)  # the tiny checkpoint's own setting
    expected = max_tokens_for_pixels(28 * 28 * 4, max_pixels, FACTOR)
    assert report["max_tokens_per_item"] == expected
    engine = MMEngine(str(path), max_model_len=512, num_kv_blocks=10, mm_processor_kwargs=overrides)
    assert engine.encoder_budget.max_tokens_per_item == expected
    # The profiling items are the largest, and the vision tower really makes that many embeddings of them.
    dummies = engine.family.dummy_items(2)
    assert [engine.family.num_tokens(d) for d in dummies] == [expected] * 2
    assert [e.shape[0] for e in engine.runner.model.encode_items(dummies)] == [expected] * 2
    # A large picture is resized under the (overridden) max_pixels.
    big = make_test_image(5, size=(400, 300))
    item = engine.input_processor.process("<|image_pad|>", [big], SamplingParams(max_tokens=1)).mm_items[0]
    assert item.length <= max_pixels // FACTOR**2


def test_budget_cli_explains_where_the_largest_item_comes_from(family_checkpoint, capsys):
    assert main(["budget", "--model", str(family_checkpoint("qwen2_5_vl")), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "max_pixels 50176" in out and "28x28 px" in out


@pytest.mark.parametrize("overrides", [{"max_pixel": 100}, {"max_pixels": 0}, {"min_pixels": 5000, "max_pixels": 4000}])
def test_bad_processor_overrides_are_config_errors(family_checkpoint, overrides):
    with pytest.raises(ConfigError, match="mm_processor_kwargs"):
        MMEngine(str(family_checkpoint("qwen2_vl")), mm_processor_kwargs=overrides)


def test_qwen3_video_resize_equals_transformers_whole_clip_rule():
    """Qwen3-VL's video bounds hold for all frames together: our shared smart_resize with num_frames
    equals transformers' video smart_resize (its module imports without torchvision) on random clips."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_clip_resize

    from mmengine.models.qwen_video import load_video_settings, resized_size

    settings = load_video_settings(None, "qwen3_vl", 16, 2, 2)
    rng = random.Random(3)
    for _ in range(500):
        frames, height, width = rng.randint(2, 300), rng.randint(8, 2000), rng.randint(8, 2000)  # thin ones too
        if max(height, width) / min(height, width) > 200:
            continue
        expected = hf_clip_resize(frames, height, width, 2, 32, settings.min_pixels, settings.max_pixels)
        assert resized_size(settings, frames, height, width) == expected
        if min(height, width) >= 32:  # (resized_size scales a thinner clip up to one factor first)
            assert smart_resize(height, width, 32, settings.min_pixels, settings.max_pixels, frames, 2) == expected


SMALL_IMAGES = 28 * 28 * 8  # max_pixels under which the largest image (40 embeddings) is below a video patch (56)


@pytest.mark.parametrize("limits,modality", [(["image=2"], "image"), (["image=2,video=0"], "image"),
                                             (['{"image": 2, "video": 0}'], "image"), (["image=2,video=1"], "video"),
                                             (["image=2", "video=1"], "video")])
def test_the_largest_item_counts_only_the_modalities_the_limits_allow(family_checkpoint, capsys, limits, modality):
    path = family_checkpoint("qwen2_5_vl")
    argv = ["budget", "--model", str(path), "--json", "--device", "cpu", "--num-kv-blocks", "10",
            "--mm-processor-kwargs", f"max_pixels={SMALL_IMAGES}"]
    for value in limits:
        argv += ["--limit-mm-per-prompt", value]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    engine_limits = {"image": 2, "video": 1 if modality == "video" else 0}
    engine = MMEngine(str(path), max_model_len=512, num_kv_blocks=10, mm_processor_kwargs={"max_pixels": SMALL_IMAGES},
                      limit_mm_per_prompt=engine_limits)
    sizes = engine.family.max_tokens_by_modality()
    assert sizes["image"] == max_tokens_for_pixels(28 * 28 * 4, SMALL_IMAGES, FACTOR) < sizes["video"]
    assert report["max_tokens_per_item"] == engine.encoder_budget.max_tokens_per_item == sizes[modality]
    assert report["items_cap"] == engine.encoder_budget.items_cap


def test_budget_cli_says_a_forbidden_modality_is_not_counted(family_checkpoint, capsys):
    assert main(["budget", "--model", str(family_checkpoint("qwen2_5_vl")), "--device", "cpu",
                 "--limit-mm-per-prompt", "image=2"]) == 0
    assert "video not allowed by limit_mm_per_prompt: not counted" in capsys.readouterr().out


@pytest.mark.parametrize("text,expected", [("image=2,video=0", {"image": 2, "video": 0}), ("image = 3", {"image": 3}),
                                           ('{"image": 2, "video": 0}', {"image": 2, "video": 0})])
def test_limits_take_vllms_json_form_and_the_comma_form(text, expected):
    from mmengine.entrypoints.engine_flags import mapping_parser

    assert mapping_parser("--limit-mm-per-prompt", int)(text) == expected


@pytest.mark.parametrize("text", ['{"image": "2"}', '{"image": true}', "[1, 2]", '{"image": 2', "image", "=2"])
def test_malformed_limits_are_refused_by_name(text):
    import argparse

    from mmengine.entrypoints.engine_flags import mapping_parser

    with pytest.raises(argparse.ArgumentTypeError, match="--limit-mm-per-prompt expects KEY=VALUE"):
        mapping_parser("--limit-mm-per-prompt", int)(text)
