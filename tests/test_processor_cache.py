"""Preprocessing is done once per picture: the processor cache in units, and through the engine
(decode and resize/normalize counts, ids and pixels equal to the HF processor's)."""

from __future__ import annotations

import gc
import io

import pytest
import torch
from transformers import AutoProcessor

from mmengine import MMEngine, SamplingParams
from mmengine.errors import CorruptImageError
from mmengine.multimodal.processor_cache import ProcessorCache
from mmengine.testing import make_test_image

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


def _jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    make_test_image(seed, size=(96, 80)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


# -- the cache alone ----------------------------------------------------------------------------


def test_lru_is_bounded_in_bytes_and_evicts_the_least_recently_used():
    cache = ProcessorCache(capacity_bytes=3 * 400)  # three 10x10 fp32 tensors
    tensors = {name: torch.full((10, 10), float(i)) for i, name in enumerate("abcd")}
    for name in "abc":
        cache.put(name, tensors[name])
    assert cache.get("a") is tensors["a"]  # a is now the most recent
    cache.put("d", tensors["d"])  # evicts b
    del tensors
    gc.collect()
    assert cache.num_bytes == 1200
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert (cache.num_hits, cache.num_misses) == (3, 1)


def test_tensors_held_by_live_requests_are_shared_past_the_capacity():
    cache = ProcessorCache(capacity_bytes=0)
    held = cache.put("x", torch.ones(4))
    assert cache.num_bytes == 0
    assert cache.put("x", torch.ones(4)) is held  # a second preprocessing of x yields the held tensor
    assert cache.get("x") is held
    del held
    gc.collect()
    assert cache.get("x") is None  # nobody holds it and there is no room: gone


def test_encoded_digests_are_bounded_in_entries():
    cache = ProcessorCache(capacity_bytes=0, max_encoded_entries=2)
    for i in range(3):
        cache.remember_encoded(f"d{i}", f"h{i}")
    assert cache.hash_of_encoded("d0") is None and cache.hash_of_encoded("d2") == "h2"


# -- through the engine -------------------------------------------------------------------------


def test_a_repeated_image_is_decoded_and_preprocessed_once(checkpoint_dir, tmp_path):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    path = tmp_path / "cat.jpg"
    path.write_bytes(_jpeg(1))
    first = engine.generate([PROMPT] * 3, images=[[path.read_bytes()]] * 3, sampling_params=PARAMS, use_tqdm=False)
    later = engine.generate([PROMPT] * 2, images=[[str(path)], [path]], sampling_params=PARAMS, use_tqdm=False)
    stats = engine.stats()
    assert stats["images_decoded"] == 1  # bytes and the same file's path: recognized by their bytes
    assert stats["images_preprocessed"] == 1
    assert stats["mm_processor_cache_hits"] == 4
    assert stats["encoder_runs"] == 1
    assert len({tuple(o.token_ids) for o in first + later}) == 1


def test_the_same_picture_in_another_form_is_preprocessed_once(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    picture = make_test_image(7, size=(64, 40))
    buf = io.BytesIO()
    picture.save(buf, "PNG")  # lossless: the decoded pixels are the picture's
    engine.generate([PROMPT] * 2, images=[[picture], [buf.getvalue()]], sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["images_decoded"] == 2  # different encodings, so both are decoded...
    assert engine.stats()["images_preprocessed"] == 1  # ...but recognized by their pixels


def test_a_known_mm_uuid_skips_decoding(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    images = [[make_test_image(s)] for s in (1, 2, 3)]
    engine.generate([PROMPT] * 3, images=images, mm_uuids=[["same"]] * 3, sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["images_decoded"] == 1 and engine.stats()["images_preprocessed"] == 1


def test_ids_and_pixels_equal_the_hf_processors(checkpoint_dir):
    path = checkpoint_dir()
    engine = MMEngine(str(path), max_model_len=256)
    hf = AutoProcessor.from_pretrained(str(path))
    a, b = make_test_image(3, size=(70, 50)), make_test_image(4, size=(30, 90))
    cases = [
        ("<image>", [a]),
        ("USER:<image><image>compare ASSISTANT:", [a, b]),
        ("USER: <image> \n <image>\n\nWhich is brighter? ASSISTANT: the", [b, a]),
        ("no image at all, just text", []),
    ]
    for prompt, images in cases:
        ours = engine.input_processor.process(prompt, images, PARAMS)
        expected = hf(text=prompt, images=images or None, return_tensors="pt")
        assert ours.prompt_token_ids == expected["input_ids"][0].tolist(), prompt
        for item, pixels in zip(ours.mm_items, expected.get("pixel_values", [])):
            torch.testing.assert_close(item.encoder_inputs["pixel_values"], pixels, rtol=0, atol=0)


def test_a_zero_capacity_keeps_only_what_live_requests_hold(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, mm_processor_cache_bytes=0)
    data = _jpeg(2)
    engine.generate([PROMPT] * 3, images=[[data]] * 3, sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["images_preprocessed"] == 1  # shared while the three requests were alive
    gc.collect()
    engine.generate([PROMPT], images=[[data]], sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["images_preprocessed"] == 2 and engine.stats()["mm_processor_cache_bytes"] == 0


def test_corrupt_bytes_are_rejected_every_time_and_never_cached(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    broken = _jpeg(5)[:200]
    for _ in range(2):
        with pytest.raises(CorruptImageError, match="image 0"):
            engine.add_request(PROMPT, images=[broken])
    assert engine.stats()["images_preprocessed"] == 0
    out = engine.generate([PROMPT], images=[[_jpeg(5)]], sampling_params=PARAMS, use_tqdm=False)
    assert len(out[0].token_ids) == 3


def test_sha256_prefix_caching_hashes_images_with_sha256_too(checkpoint_dir, tmp_path):
    """An image's hash is part of its KV blocks' identity: choosing sha256 against crafted collisions
    must cover it (and the encoded-bytes digest), or a collision there would still alias blocks."""
    path = tmp_path / "cat.jpg"
    path.write_bytes(_jpeg(6))
    hashes = {}
    for algo in ("xxh3_128", "sha256"):
        engine = MMEngine(str(checkpoint_dir()), max_model_len=256, prefix_caching_hash_algo=algo)
        first = engine.input_processor.process(PROMPT, [str(path)], PARAMS)
        again = engine.input_processor.process(PROMPT, [path.read_bytes()], PARAMS)
        assert engine.stats()["images_decoded"] == 1  # the bytes digest works under either algorithm
        hashes[algo] = first.mm_items[0].mm_hash
        assert again.mm_items[0].mm_hash == hashes[algo]
        outs = engine.generate([PROMPT] * 2, images=[[str(path)]] * 2, sampling_params=PARAMS, use_tqdm=False)
        assert outs[1].num_cached_tokens > 0 and outs[0].token_ids == outs[1].token_ids
    assert len(hashes["xxh3_128"]) == 32 and len(hashes["sha256"]) == 64
