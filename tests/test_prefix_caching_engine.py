"""Prefix caching through the public API: never wrong, and the work it saves is exactly counted."""

from __future__ import annotations

import random

import pytest

from mmengine import MMEngine, SamplingParams
from mmengine.testing import make_test_image

IMAGES = [make_test_image(seed) for seed in range(3)]
SYSTEM = "USER: You are a careful assistant who answers briefly and well about pictures and boats."


def _workload(seed: int, n: int):
    """Shared text prefixes, the same image at the same and at different offsets, different images at
    the same offset, salts, long and short prompts."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        kind = rng.randrange(5)
        img = rng.randrange(len(IMAGES))
        if kind == 0:
            prompt, images = f"{SYSTEM} <image>\nQuestion {rng.randrange(3)}? ASSISTANT:", [IMAGES[img]]
        elif kind == 1:
            prompt, images = f"USER: <image>\n{' '.join(['more'] * rng.randrange(1, 30))} ASSISTANT:", [IMAGES[img]]
        elif kind == 2:
            pad = " ".join(["x"] * rng.randrange(0, 9))
            prompt, images = f"USER: {pad} <image>\nsame image elsewhere ASSISTANT:", [IMAGES[img]]
        elif kind == 3:
            prompt, images = f"{SYSTEM} and {rng.randrange(4)} ASSISTANT:", []
        else:
            prompt, images = f"{SYSTEM} <image><image>\nboth ASSISTANT:", [IMAGES[img], IMAGES[(img + 1) % 3]]
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        requests.append((prompt, images, salt, rng.randrange(1, 8)))
    return requests


def _run_in_waves(engine: MMEngine, requests, seed: int) -> dict[int, list[int]]:
    """Requests arrive while others run, so later ones hit blocks that earlier ones computed."""
    rng = random.Random(seed)
    pending = list(enumerate(requests))
    ids: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                index, (prompt, images, salt, max_tokens) = pending.pop(0)
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                ids[engine.add_request(prompt, images, params, cache_salt=salt)] = index
        for output in engine.step() if engine.has_unfinished_requests() else []:
            if output.finished:
                outputs[ids[output.request_id]] = output.token_ids
    return outputs


@pytest.mark.parametrize("seed,num_kv_blocks", [(0, None), (1, None), (2, 24), (3, 16)])
def test_outputs_with_prefix_caching_equal_outputs_without(checkpoint_dir, seed, num_kv_blocks):
    requests = _workload(seed, 24)
    kwargs = dict(max_model_len=256, block_size=8, max_num_batched_tokens=48, num_kv_blocks=num_kv_blocks)
    cached = MMEngine(str(checkpoint_dir()), **kwargs)
    plain = MMEngine(str(checkpoint_dir()), enable_prefix_caching=False, **kwargs)
    assert _run_in_waves(cached, requests, seed) == _run_in_waves(plain, requests, seed)
    stats = cached.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["prefill_tokens_computed"] < plain.stats()["prefill_tokens_computed"]
    assert plain.stats()["prefix_cache_hits"] == 0
    if num_kv_blocks == 16:
        assert stats["num_preemptions"] > 0 or stats["kv_blocks_evicted"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_shared_prefix_is_computed_once(checkpoint_dir):
    """N prompts sharing a prefix, submitted together: prefill work is the unique tokens only."""
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, block_size=8)
    prompts = [f"{SYSTEM} <image>\nquestion number {i} ASSISTANT:" for i in range(6)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, images=[[IMAGES[0]]] * 6, sampling_params=params, use_tqdm=False)
    ids = [o.prompt_token_ids for o in outputs]
    shared = next(i for i in range(len(ids[0])) if len({tuple(t[: i + 1]) for t in ids}) > 1)
    cached_per_request = shared // 8 * 8
    # one request computes the prefix (prefix grouping may pick any of them), the others hit it
    assert sorted(o.num_cached_tokens for o in outputs) == [0] + [cached_per_request] * 5
    stats = engine.stats()
    assert stats["prefill_tokens_computed"] == sum(len(t) for t in ids) - 5 * cached_per_request
    assert stats["prefix_cache_hits"] == 5 * cached_per_request
    assert stats["prefix_cache_queries"] == sum(len(t) for t in ids)


@pytest.mark.parametrize("extra_words", range(4))
def test_full_hit_recomputes_only_the_last_token(checkpoint_dir, extra_words):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, block_size=8)
    prompt = "USER: <image>\nsame again" + " again" * extra_words + " ASSISTANT:"
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    (first,) = engine.generate(prompt, images=[IMAGES[1]], sampling_params=params, use_tqdm=False)
    before = engine.stats()["prefill_tokens_computed"]
    (second,) = engine.generate(prompt, images=[IMAGES[1]], sampling_params=params, use_tqdm=False)
    n = len(first.prompt_token_ids)
    assert second.token_ids == first.token_ids
    assert second.num_cached_tokens == min(n // 8 * 8, n - 1)
    assert engine.stats()["prefill_tokens_computed"] - before == n - second.num_cached_tokens


def test_salts_and_images_separate_caches(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, block_size=8)
    prompt = "USER: Describe this picture in a few words please. <image>\nThanks. ASSISTANT:"
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def run(images, salt=None):
        return engine.generate(prompt, images=images, sampling_params=params, use_tqdm=False, cache_salt=salt)[0]

    first = run([IMAGES[0]])
    image_offset = first.prompt_token_ids.index(engine.hf_config.image_token_id)
    assert first.num_cached_tokens == 0 and image_offset >= 8
    assert run([IMAGES[0]]).num_cached_tokens == len(first.prompt_token_ids) // 8 * 8
    assert run([IMAGES[1]]).num_cached_tokens == image_offset // 8 * 8  # only blocks before the image
    assert run([IMAGES[0]], salt="tenant").num_cached_tokens == 0
    assert run([IMAGES[0]], salt="tenant").num_cached_tokens > 0
    assert run([IMAGES[0]], salt="other").num_cached_tokens == 0


def test_same_picture_in_any_form_shares_the_cache(checkpoint_dir, tmp_path):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, block_size=8)
    path = tmp_path / "p.png"
    IMAGES[2].save(path)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    params = SamplingParams(max_tokens=2, temperature=0.0)
    first = engine.generate(prompt, images=[IMAGES[2]], sampling_params=params, use_tqdm=False)[0]
    again = engine.generate(prompt, images=[str(path)], sampling_params=params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 16


def test_reset_prefix_cache_and_stats(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, block_size=8, prefix_caching_hash_algo="sha256", prefix_caching_hash_seed=7)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.generate(prompt, images=[IMAGES[0]], sampling_params=params, use_tqdm=False)
    stats = engine.stats()
    assert stats["kv_blocks_cached"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    engine.reset_prefix_cache()
    assert engine.stats()["kv_blocks_cached"] == 0
    (out,) = engine.generate(prompt, images=[IMAGES[0]], sampling_params=params, use_tqdm=False)
    assert out.num_cached_tokens == 0
