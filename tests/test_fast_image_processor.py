"""The exact fast image preprocessing (multimodal/fast_image_processor.py) against transformers' PIL image
processors: the same pixel values bit for bit, for sizes from 28x28 to 4000x3000, extreme aspect ratios
and every picture mode, for each family's processor; the engine's tokens on a large photo equal
transformers'; and what has no fast path says so and keeps transformers' processor."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from conftest import hf_greedy, hf_logits
from PIL import Image, ImageOps
from transformers import (
    CLIPImageProcessorPil,
    Gemma4ImageProcessorPil,
    Qwen2VLImageProcessorPil,
    SiglipImageProcessorPil,
)

from mmengine import MMEngine, SamplingParams
from mmengine.models.registry import load_hf_processor
from mmengine.multimodal.fast_image_processor import fast_image_processor
from mmengine.multimodal.image_loading import load_image
from mmengine.testing.qwen_vl import qwen_vl_prompt

PROCESSORS = {
    "qwen2-vl": lambda: Qwen2VLImageProcessorPil(max_pixels=1003520),
    "qwen3-vl": lambda: Qwen2VLImageProcessorPil(patch_size=16, min_pixels=4096, max_pixels=400_000),
    "clip-crop": lambda: CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
    "siglip": lambda: SiglipImageProcessorPil(size={"height": 384, "width": 384}),
    "gemma4-280": lambda: Gemma4ImageProcessorPil(),
    "gemma4-70": lambda: Gemma4ImageProcessorPil(max_soft_tokens=70),
}
# (width, height): tiny, extreme aspect ratios (Qwen's limit is 200:1), odd sizes, 1-2 MP photos
SIZES = [(28, 28), (29, 1000), (1000, 29), (300, 199), (1920, 1080), (1080, 1920)]


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    """Random pixels: every resize rounding and every table entry is exercised."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def assert_same_output(reference, got, label: str = "") -> None:
    assert set(got) == set(reference.keys()), label
    for key in reference:
        assert got[key].dtype == reference[key].dtype and got[key].shape == reference[key].shape, f"{label} {key}"
        assert torch.equal(got[key], reference[key]), f"{label}: {key} differs"


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_pixels_equal_transformers_bit_for_bit(name):
    processor = PROCESSORS[name]()
    fast, why = fast_image_processor(processor)
    assert fast is not None, why
    for index, (width, height) in enumerate(SIZES):
        picture = noise(width, height, seed=index)
        assert_same_output(processor(images=[picture], return_tensors="pt"), fast([picture]), f"{width}x{height}")
    pictures = [noise(64, 48, seed=7), noise(40, 96, seed=8)]  # a batch of two sizes, as the engine's probes
    assert_same_output(processor(images=pictures, return_tensors="pt"), fast(pictures), "a batch")


def test_a_12_megapixel_photo_equals_transformers():
    picture = noise(4000, 3000, seed=11)
    for name in ("qwen2-vl", "clip-crop"):
        processor = PROCESSORS[name]()
        fast, _ = fast_image_processor(processor)
        assert_same_output(processor(images=[picture], return_tensors="pt"), fast([picture]))


def _encoded(picture: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, fmt, **options)
    return buffer.getvalue()


def _mode_inputs() -> dict[str, bytes]:
    rng = np.random.default_rng(3)
    base = noise(120, 90, seed=4)
    alpha = Image.fromarray(rng.integers(0, 256, (90, 120), dtype=np.uint8))
    rgba, la = base.copy(), base.convert("L")
    rgba.putalpha(alpha)
    la.putalpha(alpha)
    palette = base.convert("P", palette=Image.ADAPTIVE, colors=64)
    palette.info["transparency"] = 3
    rotated = base.copy()
    exif = rotated.getexif()
    exif[0x0112] = 6  # stored sideways: shown rotated 90 degrees
    return {
        "L": _encoded(base.convert("L"), "PNG"), "LA": _encoded(la, "PNG"), "P-transparency": _encoded(palette, "PNG"),
        "RGBA": _encoded(rgba, "PNG"), "CMYK-JPEG": _encoded(base.convert("CMYK"), "JPEG"),
        "EXIF-rotated-JPEG": _encoded(rotated, "JPEG", exif=exif.tobytes()), "RGB-JPEG": _encoded(base, "JPEG"),
    }


@pytest.mark.parametrize("name", ["qwen2-vl", "clip-crop", "gemma4-70"])
def test_every_picture_mode_through_the_engines_loading_equals_transformers(name):
    """What the engine does with a file (load_image: EXIF orientation, transparency on white, any mode to
    RGB, then the fast path) equals transformers' processor on the same file opened with PIL (its own
    conversion to RGB), EXIF orientation applied as transformers' load_image does."""
    processor = PROCESSORS[name]()
    fast, _ = fast_image_processor(processor)
    for mode, data in _mode_inputs().items():
        reference = processor(images=[ImageOps.exif_transpose(Image.open(io.BytesIO(data)))], return_tensors="pt")
        assert_same_output(reference, fast([load_image(data)]), mode)


def test_a_16_bit_png_is_scaled_not_clipped_then_preprocessed_exactly():
    """The one deliberate difference lies in loading, not here: transformers' conversion clips 16-bit values
    (40000 becomes 255), load_image scales them (image_loading.py). From the loaded picture on, the pixels
    are transformers' bit for bit."""
    values = np.random.default_rng(5).integers(0, 65536, (90, 120), dtype=np.uint16)
    picture = load_image(_encoded(Image.fromarray(values), "PNG"))
    assert picture.mode == "RGB" and np.asarray(picture).max() > 200 and np.asarray(picture).min() < 50
    processor = PROCESSORS["qwen2-vl"]()
    fast, _ = fast_image_processor(processor)
    assert_same_output(processor(images=[picture], return_tensors="pt"), fast([picture]))


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma4"])
def test_every_familys_checkpoint_processor_has_the_fast_path(family, family_checkpoint):
    processor = load_hf_processor(family_checkpoint(family)).image_processor
    fast, why = fast_image_processor(processor)
    assert fast is not None, why
    picture = noise(333, 250, seed=9)
    assert_same_output(processor(images=[picture], return_tensors="pt"), fast([picture]))


class _TorchvisionBackendImageProcessor:
    """Stands for what transformers' AutoProcessor loads where torchvision is installed: the torchvision
    backend's image processor (CLIPImageProcessor, Qwen2VLImageProcessor), not a PIL one."""


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma4"])
def test_the_engine_loads_the_pil_image_processor_where_torchvision_is_installed(family, family_checkpoint, monkeypatch):
    """torchvision cannot be installed here, so its presence is simulated: transformers says it is
    available, and AutoProcessor gives the torchvision backend's image processor, as it does then. The
    engine (and the HF reference in the tests, which loads the same way) still gets the PIL processor,
    with the same settings and overrides, its fast path, and the pixels it gives without torchvision."""
    import types

    import transformers
    from transformers.image_processing_backends import PilBackend
    from transformers.models.auto import image_processing_auto

    path = family_checkpoint(family)
    overrides = {"image_mean": [0.25, 0.5, 0.75]}
    without = load_hf_processor(path, overrides).image_processor  # (no torchvision here)
    real = transformers.AutoProcessor.from_pretrained

    def auto_processor_with_torchvision(model_dir, *args, **kwargs):  # noqa: ANN001, ANN202 - transformers' signature
        try:
            processor = real(model_dir, *args, **kwargs)
        except Exception:  # Qwen's video processor needs the torchvision that is really absent
            processor = types.SimpleNamespace()
        processor.image_processor = _TorchvisionBackendImageProcessor()
        return processor

    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: True)
    monkeypatch.setattr(image_processing_auto, "is_torchvision_available", lambda: True)
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", auto_processor_with_torchvision)
    processor = load_hf_processor(path, overrides)
    image_processor = processor.image_processor
    assert isinstance(image_processor, PilBackend) and type(image_processor) is type(without)
    assert image_processor.to_dict() == without.to_dict() and list(image_processor.image_mean) == overrides["image_mean"]
    assert not hasattr(processor, "video_processor")  # the engine patches videos itself (models/qwen_video.py)
    assert processor.tokenizer is not None and getattr(processor.tokenizer, "backend", "tokenizers") != "pil"
    fast, why = fast_image_processor(image_processor)
    assert fast is not None, why
    picture = noise(333, 250, seed=9)
    assert_same_output(without(images=[picture], return_tensors="pt"), fast([picture]))


def test_processors_without_a_fast_path_say_why():
    class Custom(CLIPImageProcessorPil):
        def _preprocess(self, images, **kwargs):  # noqa: ANN001 - transformers' signature
            return super()._preprocess(images, **kwargs)

    assert fast_image_processor(Custom())[1] == "Custom has no exact fast path"
    assert fast_image_processor(Qwen2VLImageProcessorPil(do_resize=False))[0] is None
    assert fast_image_processor(Qwen2VLImageProcessorPil(do_convert_rgb=False))[1].endswith("do_convert_rgb=False")
    assert "not one of transformers' PIL image processors" in fast_image_processor(object())[1]


def test_greedy_tokens_and_logprobs_equal_transformers_on_a_large_photo(family_checkpoint):
    """A 1920x1080 photo through the engine (fast path) and through transformers (its processor and model)."""
    path = family_checkpoint("qwen2_5_vl")
    photo = noise(1920, 1080, seed=12).resize((480, 270)).resize((1920, 1080), Image.BICUBIC)  # smooth, photo-like
    photo = Image.open(io.BytesIO(_encoded(photo, "JPEG", quality=90)))
    prompt = qwen_vl_prompt("What is in this photo?", 1)
    engine = MMEngine(str(path), device="cpu", dtype="float32", max_model_len=2048)
    out = engine.generate(prompt, images=[photo], sampling_params=SamplingParams(max_tokens=8, temperature=0,
                          ignore_eos=True, logprobs=5), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(path, prompt, [photo.convert("RGB")], 8, ignore_eos=True)
    expected = hf_logits(path, prompt, [photo.convert("RGB")]).log_softmax(-1)
    for token, value in out.logprobs[0].top:
        assert value == pytest.approx(expected[token].item(), abs=1e-5)
