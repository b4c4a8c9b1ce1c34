"""Engine behaviour through the public API: order, stops, seeds, aborts, and no leaks."""

from __future__ import annotations

import pytest

from mmengine import MMEngine, SamplingParams
from mmengine.testing import make_test_image

IMG = make_test_image(21)


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return MMEngine(str(checkpoint_dir()), max_model_len=256, block_size=8, max_num_batched_tokens=64)


def _assert_no_leaks(engine: MMEngine) -> None:
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert engine.encoder_cache.num_referenced == 0
    assert set(engine.runner.encoder_outputs) == set(engine.encoder_cache.entries)
    assert engine.scheduler.requests == {}


def test_outputs_come_back_in_input_order(engine):
    lengths = [9, 1, 5, 3, 7]
    prompts = [f"USER: <image>\nitem {i} ASSISTANT:" for i in range(len(lengths))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = engine.generate(prompts, images=[[IMG]] * len(prompts), sampling_params=params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.token_ids) for o in outputs] == lengths
    assert all(o.finish_reason == "length" for o in outputs)
    _assert_no_leaks(engine)


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    prompt = "USER: <image>\nDescribe it. ASSISTANT:"
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    (alone,) = engine.generate(prompt, images=[IMG], sampling_params=seeded, use_tqdm=False)
    others = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, ignore_eos=True)
    batch = engine.generate(
        ["USER: other ASSISTANT:", prompt, "USER: <image>\nmore ASSISTANT:"],
        images=[[], [IMG], [make_test_image(3)]],
        sampling_params=[others, seeded, others],
        use_tqdm=False,
    )
    assert batch[1].token_ids == alone.token_ids
    (other_seed,) = engine.generate(
        prompt, images=[IMG], sampling_params=SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True), use_tqdm=False
    )
    assert other_seed.token_ids != alone.token_ids


def test_stop_strings_and_stop_tokens(engine):
    prompt = "USER: <image>\nDescribe it. ASSISTANT:"
    (free,) = engine.generate(prompt, images=[IMG], sampling_params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    # stop on two visible characters from the middle of the free-running text
    middle = len(free.text) // 2
    stop_text = free.text[middle : middle + 2]
    assert len(stop_text) == 2 and "\ufffd" not in stop_text, free.text
    (stopped,) = engine.generate(
        prompt, images=[IMG], sampling_params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop_text]), use_tqdm=False
    )
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_text
    assert stopped.text == free.text[: free.text.index(stop_text)]
    assert len(stopped.token_ids) < len(free.token_ids)
    (by_token,) = engine.generate(
        prompt, images=[IMG], sampling_params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[free.token_ids[5]]), use_tqdm=False
    )
    first = free.token_ids.index(free.token_ids[5])
    assert by_token.token_ids == free.token_ids[: first + 1] and by_token.finish_reason == "stop"
    _assert_no_leaks(engine)


def test_abort_frees_everything_and_others_finish(engine):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    keep = engine.add_request("USER: <image>\nkeep ASSISTANT:", [IMG], params)
    drop = engine.add_request("USER: <image>\ndrop ASSISTANT:", [make_test_image(2)], params)
    waiting = engine.add_request("USER: never scheduled ASSISTANT:", None, params)
    delivered = {}
    while drop not in delivered:  # one call, or two with async scheduling (tokens arrive a call later)
        delivered.update((o.request_id, o.token_ids) for o in engine.step())
    assert engine.abort_request(drop) and engine.abort_request(waiting)
    assert not engine.abort_request("no-such-request")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    reasons = {o.request_id: o.finish_reason for o in finished}
    assert len(finished) == 3 and reasons == {drop: "abort", waiting: "abort", keep: "length"}
    assert len(finished[-1].token_ids) == 6 and finished[0].token_ids == delivered[drop] == delivered[drop][:1]
    _assert_no_leaks(engine)


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("USER: a ASSISTANT:", request_id="same")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("USER: b ASSISTANT:", request_id="same")
    engine.abort_request("same")


def test_chat_template_matches_the_plain_prompt(engine):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    (chat,) = engine.chat(messages, images=[IMG], sampling_params=params, use_tqdm=False)
    (plain,) = engine.generate("USER: <image>\nWhat is it? ASSISTANT:", images=[IMG], sampling_params=params, use_tqdm=False)
    assert chat.prompt == plain.prompt and chat.token_ids == plain.token_ids


def test_stats_count_work(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(["USER: <image>\na ASSISTANT:", "USER: <image><image>\nb ASSISTANT:"], images=[[IMG], [IMG, IMG]], sampling_params=params, use_tqdm=False)
    stats = engine.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    assert stats["prompt_tokens"] == prompt_tokens
    assert stats["generation_tokens"] == 8 and stats["requests_finished"] == 2
    assert stats["tokens_computed"] == prompt_tokens + 2 * 3  # last output token is never fed back
    assert stats["encoder_runs"] == 1  # one picture, three occurrences: encoded once
    assert stats["encoder_cache_hits"] == 2 and stats["encoder_cache_misses"] == 1
