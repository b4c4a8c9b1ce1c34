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


# -- concurrent preprocessing -----------------------------------------------------------------------


def _slow_preprocess(processor, fail_first: bool = False):
    """Makes the image processor slow (so concurrent calls overlap) and, optionally, fail its first call."""
    import threading
    import time

    original, calls, lock = processor._preprocess, [], threading.Lock()

    def slow(images):
        with lock:
            calls.append(len(images))
            first = len(calls) == 1
        time.sleep(0.2)
        if fail_first and first:
            raise MemoryError("injected failure")
        return original(images)

    processor._preprocess = slow
    return calls


@pytest.mark.parametrize("as_bytes", [False, True], ids=["pil", "encoded"])
def test_a_picture_several_threads_bring_at_once_is_preprocessed_once(checkpoint_dir, as_bytes):
    from concurrent.futures import ThreadPoolExecutor

    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    processor = engine.input_processor
    calls = _slow_preprocess(processor)
    picture = _jpeg(7) if as_bytes else make_test_image(7, size=(96, 80))
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: processor.process(PROMPT, [picture], PARAMS), range(6)))
    assert calls == [1] and processor.num_images_preprocessed == 1
    assert processor.num_images_decoded == (1 if as_bytes else 6)  # the same bytes are decoded once; each picture is read
    first = results[0].mm_items[0]
    assert all(r.mm_items[0].mm_hash == first.mm_hash and r.mm_items[0].encoder_inputs is first.encoder_inputs for r in results)
    assert processor.cache.num_misses == 1 and processor.cache.num_hits == 5  # as one thread after another would count


def test_when_the_preprocessing_thread_fails_a_waiting_one_does_it(checkpoint_dir):
    from concurrent.futures import ThreadPoolExecutor

    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    processor = engine.input_processor
    calls = _slow_preprocess(processor, fail_first=True)
    picture = make_test_image(8, size=(96, 80))
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(processor.process, PROMPT, [picture], PARAMS) for _ in range(3)]
        outcomes = [f.exception() or f.result() for f in futures]
    failures = [o for o in outcomes if isinstance(o, MemoryError)]
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(failures) == 1 and len(done) == 2 and len(calls) == 2 and processor.num_images_preprocessed == 1
    assert done[0].mm_items[0].encoder_inputs is done[1].mm_items[0].encoder_inputs
    assert not len(processor._preprocessing)  # no lock left behind


def test_generate_preprocesses_a_batch_on_threads_with_the_serial_counts(checkpoint_dir, monkeypatch):
    import mmengine.engine.intake

    prompts = [PROMPT] * 8
    images = [[make_test_image(20 + i % 3, size=(96, 80))] for i in range(8)]
    runs = {}
    for threads in (1, 4):
        monkeypatch.setattr(mmengine.engine.intake, "PREPROCESS_THREADS", threads)
        engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
        calls = _slow_preprocess(engine.input_processor)
        outputs = engine.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
        stats = engine.stats()
        runs[threads] = ([o.token_ids for o in outputs], {k: stats[k] for k in (
            "images_decoded", "images_preprocessed", "mm_processor_cache_hits", "encoder_runs")}, sum(calls))
    assert runs[4] == runs[1]
    assert runs[1][1]["images_preprocessed"] == 3 and runs[1][2] == 3


def test_a_bad_prompt_stops_its_batch_with_nothing_left_running(checkpoint_dir, monkeypatch):
    """Prompt 3 of 6 has a corrupt image and fails at once while prompts 4 and 5 are still being
    preprocessed: generate() raises only once those are done (or dropped before they began), so nothing of
    the batch runs on after it: the counters stay, no keyed lock is held, nothing is queued or holds
    blocks or encoder references, and the next call is served."""
    import threading

    import mmengine.engine.intake
    from books import assert_books_consistent

    monkeypatch.setattr(mmengine.engine.intake, "PREPROCESS_THREADS", 6)  # no prompt waits for a thread
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    processor = engine.input_processor
    original, slow_size = processor._preprocess, (64, 48)
    returned = threading.Event()
    active: list[int] = []  # the slow preprocessing calls under way
    changed = threading.Condition()

    def slow(images):
        if images[0].size != slow_size:
            return original(images)
        with changed:
            active.append(1)
        try:
            # held until generate() has returned; a generate() that waits for this call cannot return first, so the
            # hold is bounded (the outcome is the same either way: only the test's time depends on the bound)
            returned.wait(timeout=1.0)
            return original(images)
        finally:
            with changed:
                active.pop()
                changed.notify_all()

    processor._preprocess = slow
    images = [[make_test_image(30 + i, size=slow_size if i >= 4 else (96, 80))] for i in range(6)]
    images[3] = [_jpeg(33)[:200]]  # truncated: fails as it is decoded
    with pytest.raises(CorruptImageError) as err:
        engine.generate([PROMPT] * 6, images=images, sampling_params=PARAMS, use_tqdm=False)
    running_at_return, locks_at_return = len(active), (len(processor._preprocessing), len(processor._decoding))
    counters = (processor.num_images_decoded, processor.num_images_preprocessed)
    returned.set()
    with changed:
        assert changed.wait_for(lambda: not active, timeout=30)
    assert err.value.prompt_index == 3
    assert running_at_return == 0 and locks_at_return == (0, 0)
    assert (processor.num_images_decoded, processor.num_images_preprocessed) == counters  # nothing went on behind its back
    stats = engine.stats()
    assert stats["prompt_tokens"] == stats["requests_running"] == stats["requests_waiting"] == 0  # nothing was queued
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["encoder_cache_referenced"] == 0
    assert_books_consistent(engine)

    images[3] = [make_test_image(33, size=(96, 80))]
    outputs = engine.generate([PROMPT] * 6, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [3] * 6
    assert processor.num_images_preprocessed == 6 and not len(processor._preprocessing)
    assert_books_consistent(engine)


def test_threads_bringing_the_same_broken_bytes_each_get_the_error(checkpoint_dir):
    from concurrent.futures import ThreadPoolExecutor

    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    processor = engine.input_processor
    broken = _jpeg(9)[:200]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(processor.process, PROMPT, [broken], PARAMS) for _ in range(4)]
        errors = [f.exception(timeout=30) for f in futures]
    assert all(isinstance(e, CorruptImageError) for e in errors)
    assert not len(processor._preprocessing) and not len(processor._decoding)


def test_a_picture_object_a_batch_repeats_is_read_and_hashed_once(checkpoint_dir):
    """generate() with 12 prompts over 3 picture objects reads (and hashes) 3 pictures; equal
    copies (distinct objects) are each read, and give the same items and tokens."""
    pictures = [make_test_image(seed, size=(90, 70)) for seed in (1, 2, 3)]
    prompts = [f"USER: <image>\nQuestion {i}? ASSISTANT:" for i in range(12)]
    results = {}
    for shared in (True, False):
        engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
        images = [[pictures[i % 3] if shared else pictures[i % 3].copy()] for i in range(12)]
        outs = engine.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
        stats = engine.stats()
        assert stats["images_decoded"] == (3 if shared else 12)
        assert engine.input_processor.num_images_preprocessed == 3
        results[shared] = [o.token_ids for o in outs]
    assert results[True] == results[False]
    # the memo lives for one call: a later call reads the picture again (it may have changed since)
    engine.generate(prompts[:2], images=[[pictures[0]], [pictures[0]]], sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["images_decoded"] == 12 + 1


def test_many_threads_over_many_shared_pictures_read_each_once(checkpoint_dir, monkeypatch):
    """Concurrent generate() calls on many threads, each batch naming shared picture objects, shared
    encoded bytes and shared user ids many times: per call, each object is read once; across calls,
    equal bytes are decoded once and equal user ids read once, and every item is preprocessed once.
    The image loader is slowed so that threads collide on the same keys."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import mmengine.engine.intake
    import mmengine.multimodal.picture_preparer as preparer_module

    monkeypatch.setattr(mmengine.engine.intake, "PREPROCESS_THREADS", 6)
    original_load, reads, lock = preparer_module.load_image, {}, threading.Lock()

    def slow_load(image, **kwargs):
        key = ("bytes", bytes(kwargs["encoded"])) if kwargs.get("encoded") is not None else ("object", id(image))
        with lock:
            reads[key] = reads.get(key, 0) + 1
        time.sleep(0.01)
        return original_load(image, **kwargs)

    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)  # (its start-up warm-up reads a picture of its own)
    monkeypatch.setattr(preparer_module, "load_image", slow_load)
    processor = engine.input_processor
    pictures = [make_test_image(40 + i, size=(48 + 8 * i, 40)) for i in range(4)]
    encoded = [_jpeg(50 + i) for i in range(3)]
    named = [make_test_image(60 + i, size=(40, 56)) for i in range(2)]
    prompt = "USER: <image><image><image>\nCompare. ASSISTANT:"
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    num_callers, per_call = 4, 6

    def caller(c: int) -> list[list[str]]:
        images = [[pictures[(c + i) % 4], encoded[i % 3], named[i % 2]] for i in range(per_call)]
        uuids = [[None, None, f"named-{i % 2}"] for i in range(per_call)]
        outs = engine.generate([prompt] * per_call, images=images, sampling_params=params, use_tqdm=False, mm_uuids=uuids)
        return [o.token_ids for o in outs]

    with ThreadPoolExecutor(num_callers) as pool:
        results = list(pool.map(caller, range(num_callers)))
    assert all(len(r) == per_call for r in results)
    for picture in pictures:  # each call reads each of its objects once (the memo lives for one call)
        assert reads[("object", id(picture))] == num_callers
    for data in encoded:  # equal bytes are decoded once across all calls
        assert reads[("bytes", data)] == 1
    assert sum(reads.get(("object", id(p)), 0) for p in named) == 2  # one read per user id, across calls
    assert processor.num_images_decoded == sum(reads.values()) == 4 * num_callers + 3 + 2
    assert processor.num_images_preprocessed == 4 + 3 + 2
    assert not len(processor._preprocessing) and not len(processor._decoding)
