"""Bad input fails with a typed ValueError naming the prompt and reason; other requests are unharmed."""

from __future__ import annotations

import io

import pytest

from mmengine import MMEngine, SamplingParams
from mmengine.errors import (
    ConfigError,
    CorruptImageError,
    ImageCountMismatchError,
    ImageTooLargeError,
    InvalidInputError,
    PromptTooLongError,
    TooManyImagesError,
    UnsupportedImageTypeError,
)
from mmengine.testing import make_test_image

GOOD = "USER: <image>\nWhat is this? ASSISTANT:"
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return MMEngine(str(checkpoint_dir()), max_model_len=128, limit_mm_per_prompt={"image": 2}, max_image_pixels=10_000)


def _png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


BAD_INPUTS = [
    ("USER: <image>\nhi ASSISTANT:", [], ImageCountMismatchError, "1 <image> marker(s) but 0 image(s)"),
    ("USER: hi ASSISTANT:", ["IMG"], ImageCountMismatchError, "0 <image> marker(s) but 1 image(s)"),
    ("USER: <image><image>\nhi ASSISTANT:", ["IMG"], ImageCountMismatchError, "2 <image> marker(s) but 1 image(s)"),
    ("<image><image><image>", ["IMG"] * 3, TooManyImagesError, "at most 2"),
    (GOOD, [b"definitely not an image"], CorruptImageError, "image 0"),
    (GOOD, ["TRUNCATED"], CorruptImageError, "image 0"),
    (GOOD, ["/no/such/file.png"], CorruptImageError, "/no/such/file.png"),
    (GOOD, ["HUGE"], ImageTooLargeError, "exceeds max_image_pixels=10000"),
    (GOOD, [42], UnsupportedImageTypeError, "int"),
    ("USER: " + "word " * 200 + "ASSISTANT:", [], PromptTooLongError, "exceeds max_model_len=128"),
]


def _materialize(images):
    lookup = {
        "IMG": make_test_image(1),
        "TRUNCATED": _png_bytes(make_test_image(2))[:60],
        "HUGE": make_test_image(3, size=(200, 200)),
    }
    return [lookup.get(i, i) if isinstance(i, str) else i for i in images]


@pytest.mark.parametrize("prompt,images,error,fragment", BAD_INPUTS, ids=[b[2].__name__ + str(i) for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_raises_typed_error_naming_prompt(engine, prompt, images, error, fragment):
    good_image = [make_test_image(0)]
    with pytest.raises(error) as info:
        engine.generate([GOOD, prompt], images=[good_image, _materialize(images)], sampling_params=PARAMS, use_tqdm=False)
    assert isinstance(info.value, ValueError)
    assert info.value.prompt_index == 1
    assert str(info.value).startswith("prompt 1: ")
    assert fragment in str(info.value)
    assert not engine.has_unfinished_requests()  # the good prompt was not queued either


def test_batch_shape_errors(engine):
    with pytest.raises(InvalidInputError, match="one list per prompt"):
        engine.generate(["a", "b"], images=[[]], use_tqdm=False)
    with pytest.raises(InvalidInputError, match="one per prompt"):
        engine.generate(["a", "b"], sampling_params=[PARAMS], use_tqdm=False)
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_bad_request_leaves_in_flight_requests_unharmed(engine):
    images = [make_test_image(5), make_test_image(6), make_test_image(7)]
    reference = engine.generate([GOOD] * 3, images=[[img] for img in images], sampling_params=PARAMS, use_tqdm=False)

    ids = [engine.add_request(GOOD, [img], PARAMS) for img in images]
    engine.step()
    engine.step()
    for prompt, bad_images, error, _ in BAD_INPUTS:
        with pytest.raises(error):
            engine.add_request(prompt, _materialize(bad_images), PARAMS)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finished[i].token_ids for i in ids] == [r.token_ids for r in reference]
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_generate_never_swallows_add_request_outputs(engine):
    """generate() steps every request, but hands add_request()'s outputs on to step() untouched."""
    request_id = engine.add_request(GOOD, [make_test_image(1)], PARAMS)
    (out,) = engine.generate("USER: hi ASSISTANT:", sampling_params=PARAMS, use_tqdm=False)
    assert out.finished and out.request_id != request_id
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert seen and all(o.request_id == request_id for o in seen) and seen[-1].finished
    (alone,) = engine.generate(GOOD, images=[make_test_image(1)], sampling_params=PARAMS, use_tqdm=False)
    assert seen[-1].token_ids == alone.token_ids


def test_prompt_that_cannot_fit_the_kv_cache_is_rejected(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=512, block_size=8, num_kv_blocks=4)
    with pytest.raises(PromptTooLongError, match="whole KV cache"):
        engine.generate("USER: " + "word " * 40 + "ASSISTANT:", sampling_params=PARAMS, use_tqdm=False)


@pytest.mark.parametrize("mode", ["RGBA", "L", "CMYK", "P"])
def test_image_modes_are_converted(engine, mode):
    """Any PIL mode works and equals giving the same picture already converted to RGB."""
    from mmengine.multimodal.image_loading import load_image

    img = make_test_image(9, mode=mode)
    (out,) = engine.generate(GOOD, images=[img], sampling_params=PARAMS, use_tqdm=False)
    (ref,) = engine.generate(GOOD, images=[load_image(img)], sampling_params=PARAMS, use_tqdm=False)
    assert out.token_ids == ref.token_ids


def test_image_input_types_are_equivalent(engine, tmp_path):
    import numpy as np

    img = make_test_image(4)
    path = tmp_path / "img.png"
    img.save(path)
    variants = [img, str(path), path, _png_bytes(img), np.asarray(img)]
    outputs = engine.generate([GOOD] * len(variants), images=[[v] for v in variants], sampling_params=PARAMS, use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outputs}) == 1


def test_engine_config_errors(checkpoint_dir, tmp_path):
    from mmengine.errors import UnsupportedModelError

    with pytest.raises(ConfigError, match="unknown engine option"):
        MMEngine(str(checkpoint_dir()), max_num_seq=4)
    with pytest.raises(ConfigError, match="block_size"):
        MMEngine(str(checkpoint_dir()), block_size=12)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        MMEngine(str(checkpoint_dir()), max_model_len=10**7)
    with pytest.raises(ConfigError, match="attn_backend"):
        MMEngine(str(checkpoint_dir()), attn_backend="flash")
    with pytest.raises(ConfigError, match="mm_processor_cache_bytes"):
        MMEngine(str(checkpoint_dir()), mm_processor_cache_bytes=-1)
    with pytest.raises(UnsupportedModelError, match="config.json"):
        MMEngine(str(tmp_path))
