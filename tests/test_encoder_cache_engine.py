"""The global encoder cache through the public API: each picture encoded once, never a wrong or
repeated encode after a prefix hit, and no crash in the corner cases that crash other engines."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmengine import MMEngine, SamplingParams
from mmengine.core.scheduler import ScheduledRequest, SchedulerOutput
from mmengine.testing import make_test_image

IMAGES = [make_test_image(100 + i) for i in range(6)]
M = 16  # embeddings per image of the default tiny checkpoint
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _engines(checkpoint_dir, **kwargs):
    path = str(checkpoint_dir())
    return MMEngine(path, **kwargs), MMEngine(path, enable_prefix_caching=False, **kwargs)


def _find_prompt(engine: MMEngine, block_size: int, remainder: int, placement: str) -> str:
    """A one-image prompt whose length is remainder mod block_size, with the image placed as asked."""
    tails = ["", "\nx", "\nwhat", "\nwhat is it", "\nwhat is it now", "\nplease describe it", "\nplease describe it well"]
    for pad in range(0, 80):
        for tail in tails:
            prompt = "USER:" + " a" * pad + " <image>" + tail
            processed = engine.input_processor.process(prompt, [IMAGES[0]], PARAMS)
            n, item = len(processed.prompt_token_ids), processed.mm_items[0]
            if n % block_size != remainder or n < 2 * block_size:
                continue
            full_end = n // block_size * block_size  # end of the last full block (what a hit can cover)
            if placement == "ends_in_last_full_block" and full_end - block_size < item.end <= full_end and item.end < n:
                return prompt
            if placement == "ends_at_prompt_end" and item.end == n:
                return prompt
            if placement == "starts_in_last_full_block" and item.offset >= full_end - block_size:
                return prompt
    raise AssertionError(f"no prompt for remainder={remainder} placement={placement}")


CRASH_CASES = [
    (8, 0, "ends_in_last_full_block"),
    (8, 0, "ends_at_prompt_end"),
    (8, 1, "ends_in_last_full_block"),
    (8, 7, "ends_in_last_full_block"),
    (8, 1, "ends_at_prompt_end"),
    (8, 7, "ends_at_prompt_end"),
    (32, 0, "starts_in_last_full_block"),
    (32, 31, "starts_in_last_full_block"),
    (32, 1, "starts_in_last_full_block"),
]


@pytest.mark.parametrize("block_size,remainder,placement", CRASH_CASES)
@pytest.mark.parametrize("copies", [2, 5])
def test_identical_requests_with_the_image_in_the_recomputed_block(checkpoint_dir, block_size, remainder, placement, copies):
    """vLLM's #11895 crash: identical requests, prompt length divisible by the block size, the image in
    the recomputed last block, an encoder budget of one item. Here: no crash, same outputs, one encode."""
    kwargs = dict(max_model_len=256, block_size=block_size, encoder_cache_size=M)
    cached, plain = _engines(checkpoint_dir, **kwargs)
    prompt = _find_prompt(cached, block_size, remainder, placement)
    outputs = cached.generate([prompt] * copies, images=[[IMAGES[0]]] * copies, sampling_params=PARAMS, use_tqdm=False)
    again = cached.generate(prompt, images=[IMAGES[0]], sampling_params=PARAMS, use_tqdm=False)  # a full hit later
    reference = plain.generate([prompt] * copies, images=[[IMAGES[0]]] * copies, sampling_params=PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference] == [again[0].token_ids] * copies
    stats = cached.stats()
    assert stats["encoder_runs"] == 1
    assert stats["reencodes_after_prefix_hit"] == 0
    assert again[0].num_cached_tokens > 0


def test_one_image_across_many_prompts_is_encoded_once(checkpoint_dir):
    cached, plain = _engines(checkpoint_dir, max_model_len=256, block_size=8)
    prompts = [f"USER: <image>\n{q} ASSISTANT:" for q in ("What?", "Colours?", "Count the shapes.", "Is it big?")]
    outputs = cached.generate(prompts, images=[[IMAGES[1]]] * 4, sampling_params=PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [
        o.token_ids for o in plain.generate(prompts, images=[[IMAGES[1]]] * 4, sampling_params=PARAMS, use_tqdm=False)
    ]
    stats = cached.stats()
    assert stats["encoder_runs"] == 1 and stats["encoder_cache_misses"] == 1 and stats["encoder_cache_hits"] >= 0
    assert stats["reencodes_after_prefix_hit"] == 0


def test_multi_turn_chat_encodes_each_image_once(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=512, block_size=8, encoder_cache_size=M, num_kv_blocks=64)
    messages, images = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"And picture {turn}?"}]})
        images.append(IMAGES[turn])
        (out,) = engine.chat(messages, images=list(images), sampling_params=PARAMS, use_tqdm=False)
        messages.append({"role": "assistant", "content": [{"type": "text", "text": "It is a picture."}]})
        assert turn == 0 or out.num_cached_tokens > 0
    stats = engine.stats()
    assert stats["encoder_runs"] == 4
    assert stats["reencodes_after_prefix_hit"] == 0


def test_different_images_at_the_same_offset_are_never_confused(checkpoint_dir):
    cached, plain = _engines(checkpoint_dir, max_model_len=256, block_size=8)
    prompt = "USER: Look at this carefully. <image>\nWhat is it? ASSISTANT:"
    ours = cached.generate([prompt] * 6, images=[[img] for img in IMAGES], sampling_params=PARAMS, use_tqdm=False)
    reference = plain.generate([prompt] * 6, images=[[img] for img in IMAGES], sampling_params=PARAMS, use_tqdm=False)
    assert [o.token_ids for o in ours] == [r.token_ids for r in reference]
    assert len({tuple(o.token_ids) for o in ours}) > 1  # the pictures really change the output
    assert cached.stats()["encoder_runs"] == 6


def test_zero_token_steps_are_harmless(checkpoint_dir):
    """An encoder budget of one item: requests wait at their image with zero tokens, then finish."""
    cached, plain = _engines(checkpoint_dir, max_model_len=256, block_size=8, encoder_cache_size=M)
    prompts = [f"USER: {'word ' * i}<image>\nDescribe. ASSISTANT:" for i in range(6)]
    images = [[img] for img in IMAGES]
    ours = cached.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert cached.scheduler.num_zero_token_schedules > 0
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)]
    assert cached.encoder_cache.num_referenced == 0


def test_runner_steps_with_encoder_work_only(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    request_id = engine.add_request("USER: <image>\nhi ASSISTANT:", [IMAGES[2]], PARAMS)
    request = engine.scheduler.requests[request_id]
    out = SchedulerOutput(scheduled=[ScheduledRequest(request, 0, 0, [0])])
    assert engine.runner.execute(out, {request_id: []}) == {}
    assert engine.runner.encoder_outputs[request.mm_items[0].mm_hash].shape == (M, 64)
    engine.abort_request(request_id)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 2), st.booleans()), min_size=4, max_size=14))
def test_tight_caches_random_images(checkpoint_dir, workload):
    """One item plus slack in the encoder cache, a small KV cache, many images: no crash, no deadlock,
    outputs equal to the uncached run, and nothing left referenced."""
    kwargs = dict(max_model_len=256, block_size=8, encoder_cache_size=2 * M, num_kv_blocks=20, max_num_batched_tokens=32)
    cached, plain = _engines(checkpoint_dir, **kwargs)
    prompts, images = [], []
    for first, second, shape, two in workload:
        head = ["USER:", "USER: Look.", "USER: Look at this one please."][shape]
        if two:
            prompts.append(f"{head} <image> and <image>\nCompare. ASSISTANT:")
            images.append([IMAGES[first], IMAGES[second]])
        else:
            prompts.append(f"{head} <image>\nWhat? ASSISTANT:")
            images.append([IMAGES[first]])
    ours = cached.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    reference = plain.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert [o.token_ids for o in ours] == [r.token_ids for r in reference]
    stats = cached.stats()
    assert stats["reencodes_after_prefix_hit"] == 0
    assert cached.encoder_cache.num_referenced == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert set(cached.runner.encoder_outputs) == set(cached.encoder_cache.entries)


def test_mm_uuids_and_reset(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    prompt = "USER: <image>\nWhat? ASSISTANT:"
    engine.generate([prompt, prompt], images=[[IMAGES[0]], [IMAGES[0]]], mm_uuids=[["cat"], ["cat-copy"]], sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["encoder_runs"] == 2  # different ids: treated as different items
    engine.generate(prompt, images=[IMAGES[3]], mm_uuids=["cat"], sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["encoder_runs"] == 2  # same id: trusted to be the same item
    engine.reset_encoder_cache()
    assert engine.stats()["encoder_cache_entries"] == 0 and engine.runner.encoder_outputs == {}
    # The KV blocks that pinned the dropped entries left the prefix cache with them, so the next
    # request's hit stops before its image: one fresh encode, not a re-encode after a hit.
    (out,) = engine.generate(prompt, images=[IMAGES[0]], mm_uuids=["cat"], sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["encoder_runs"] == 3 and engine.stats()["reencodes_after_prefix_hit"] == 0
    assert out.num_cached_tokens <= out.prompt_token_ids.index(engine.hf_config.image_token_id)
    engine.reset_prefix_cache()
    (out,) = engine.generate(prompt, images=[IMAGES[0]], mm_uuids=["cat"], sampling_params=PARAMS, use_tqdm=False)
    assert out.num_cached_tokens == 0 and engine.stats()["encoder_runs"] == 3  # the encoder cache still has it


def test_queued_requests_share_one_pixel_tensor_per_picture(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    ids = [engine.add_request("USER: <image>\nWhat? ASSISTANT:", [img], PARAMS) for img in (IMAGES[0], IMAGES[0], IMAGES[1])]
    pixels = [engine.scheduler.requests[i].mm_items[0].encoder_inputs["pixel_values"] for i in ids]
    assert pixels[0] is pixels[1] and pixels[0] is not pixels[2]
    for request_id in ids:
        engine.abort_request(request_id)
