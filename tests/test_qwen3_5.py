"""Qwen3.5 beyond the family-wide tests (conftest.FAMILIES runs every engine test on it too): greedy
tokens and logits equal transformers' with its hybrid decoder, chunked prefill that cuts the recurrence
and pictures, preemption, and the prefix cache's counts with recurrent-state checkpoints."""

from __future__ import annotations

import random

import pytest

from books import assert_books_consistent
from conftest import hf_greedy, hf_logits
from mmengine import MMEngine, SamplingParams
from mmengine.testing import make_test_image
from mmengine.testing.qwen_vl import qwen_vl_prompt

BLOCK = 16
PICTURES = [make_test_image(21, size=(96, 96)), make_test_image(22, size=(64, 160))]
QUESTION = "Compare them and say more about everything here, one thing after another."


@pytest.fixture(scope="module")
def path(family_checkpoint):
    return family_checkpoint("qwen3_5")


def _engine(path, **kwargs) -> MMEngine:
    return MMEngine(str(path), device="cpu", dtype="float32", max_model_len=512, **kwargs)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunks-of-8"])
@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_greedy_tokens_equal_transformers(path, num_images, chunk):
    """Chunks of 8 tokens end inside the recurrence and inside the pictures (34 and 40 tokens)."""
    prompt = qwen_vl_prompt(QUESTION, num_images)
    engine = _engine(path, **({"max_num_batched_tokens": chunk} if chunk else {}))
    (out,) = engine.generate(prompt, images=PICTURES[:num_images] or None, sampling_params=_greedy(12), use_tqdm=False)
    assert out.token_ids == hf_greedy(path, prompt, PICTURES[:num_images] or None, 12, ignore_eos=True)


def test_logits_equal_transformers_with_two_pictures(path):
    prompt = qwen_vl_prompt("Compare them.", 2)
    (out,) = _engine(path).generate(prompt, images=PICTURES, sampling_params=SamplingParams(max_tokens=1, logprobs=8),
                                    use_tqdm=False)
    expected = hf_logits(path, prompt, PICTURES).log_softmax(-1)
    for token, value in out.logprobs[0].top:
        assert value == pytest.approx(expected[token].item(), abs=1e-5)


def test_a_batch_under_preemption_gives_each_prompt_its_tokens_alone(path):
    """Eight different prompts in 40 KV blocks of 4 tokens: requests are preempted and resume (from their
    own checkpoint, or from nothing); each still gets what transformers gives it alone."""
    prompts = [qwen_vl_prompt(f"Question {i}: " + "what is here? " * (i % 3), i % 3) for i in range(8)]
    images = [PICTURES[: i % 3] or None for i in range(8)]
    engine = _engine(path, block_size=4, num_kv_blocks=40, enable_prefix_grouping=False)
    outs = engine.generate(prompts, images=images, sampling_params=_greedy(16), use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    for prompt, pics, out in zip(prompts, images, outs):
        assert out.token_ids == hf_greedy(path, prompt, pics, 16, ignore_eos=True)


def _computed(engine: MMEngine, prompt, **kwargs) -> tuple[int, list[int]]:
    """(prompt tokens computed, greedy tokens) of one request."""
    before = engine.stats()["prefill_tokens_computed"]
    (out,) = engine.generate(prompt, sampling_params=_greedy(4), use_tqdm=False, **kwargs)
    return engine.stats()["prefill_tokens_computed"] - before, out.token_ids


@pytest.mark.parametrize("length", [30, 32, 48])
def test_a_repeated_prompt_recomputes_at_most_one_block(path, length):
    ids = [random.Random(length).randrange(10, 300) for _ in range(length)]
    engine = _engine(path)
    first, tokens = _computed(engine, {"prompt_token_ids": ids})
    again, repeated = _computed(engine, {"prompt_token_ids": ids})
    assert first == length and 0 < again <= BLOCK and repeated == tokens
    assert engine.stats()["state_checkpoint_hits"] == 1
    plain = _engine(path, enable_prefix_caching=False)
    assert _computed(plain, {"prompt_token_ids": ids}) == (length, tokens)
    assert _computed(plain, {"prompt_token_ids": ids})[0] == length  # what prefix caching off (vLLM below 528 tokens) costs


def test_a_four_turn_image_chat_recomputes_only_the_new_message_and_the_last_partial_block(path):
    """Each turn's prompt is the last one, its answer and a new question: it resumes from the checkpoint
    the previous turn left at its last block boundary. The picture is encoded once in all."""
    engine, plain = _engine(path), _engine(path, enable_prefix_caching=False)
    tokenizer = engine.tokenizer
    # a random-weight model may emit a placeholder token, which a token prompt must not hold outside a picture
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            logit_bias={engine.family.image_token_id: -100.0, engine.family.video_token_id: -100.0})
    history = tokenizer.encode(qwen_vl_prompt("What is in this picture?", 1))
    for turn in range(4):
        if turn:
            new = tokenizer.encode(f"<|im_end|>\n<|im_start|>user\nAnd question {turn}, please?<|im_end|>\n<|im_start|>assistant\n")
            history = history + new
        prompt = {"prompt_token_ids": history}
        before = engine.stats()["prefill_tokens_computed"]
        (out,) = engine.generate(prompt, images=PICTURES[:1], sampling_params=params, use_tqdm=False)
        computed = engine.stats()["prefill_tokens_computed"] - before
        (reference,) = plain.generate(prompt, images=PICTURES[:1], sampling_params=params, use_tqdm=False)
        assert out.token_ids == reference.token_ids
        if turn:
            last_turn = len(previous_history)  # noqa: F821 - set below on the previous turn
            assert computed <= len(new) + (last_turn % BLOCK or BLOCK), (turn, computed, len(new))
        previous_history = out.prompt_token_ids + out.token_ids
        history = list(previous_history)
    stats = engine.stats()
    assert stats["encoder_runs"] == 1 and stats["reencodes_after_prefix_hit"] == 0
    assert stats["state_checkpoint_hits"] == 3


def test_prompts_sharing_a_system_prompt_recompute_only_their_tail_from_the_third_on(path):
    """The second request finds the shared blocks but no checkpoint at their end: it recomputes them
    (writing no KV) and leaves one there, a branch point, so every later request resumes from it."""
    rng = random.Random(7)
    system = [rng.randrange(10, 300) for _ in range(70)]
    tails = [[rng.randrange(10, 300) for _ in range(rng.randrange(5, 30))] for _ in range(6)]
    engine = _engine(path)
    costs = [_computed(engine, {"prompt_token_ids": system + tail})[0] for tail in tails]
    shared_end = 70 // BLOCK * BLOCK
    assert costs[0] == len(system + tails[0]) and costs[1] <= len(system + tails[1])  # (no recomputation if the first's prompt checkpoint is the shared end)
    assert all(cost <= len(system + tail) - shared_end for cost, tail in zip(costs[2:], tails[2:])), costs
    # all at once: prefix grouping computes the shared blocks once, the first request's chunk ends there
    batch = _engine(path)
    outs = batch.generate([{"prompt_token_ids": system + tail} for tail in tails], sampling_params=_greedy(4), use_tqdm=False)
    assert batch.stats()["prefill_tokens_computed"] <= shared_end + sum(len(system + t) - shared_end for t in tails)
    plain = _engine(path, enable_prefix_caching=False)
    expected = plain.generate([{"prompt_token_ids": system + tail} for tail in tails], sampling_params=_greedy(4), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


def test_under_kv_and_checkpoint_pressure_tokens_equal_prefix_caching_off_and_everything_is_freed(path):
    """Shuffled repeats, shared prefixes and pictures through 24 KV blocks and 3 checkpoints: blocks
    and checkpoints are evicted, the books agree after every step, and at the end every block,
    checkpoint slot and encoder reference is free."""
    rng = random.Random(3)
    system = [rng.randrange(10, 300) for _ in range(40)]
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = []
    for i in range(6):
        if i % 2:
            prompts.append(({"prompt": f"<|im_start|>user\n{marker}Picture {i} again?<|im_end|>\n<|im_start|>assistant\n"},
                            [PICTURES[i % 2]]))
        else:
            prompts.append(({"prompt_token_ids": system + [rng.randrange(10, 300) for _ in range(rng.randrange(3, 20))]}, None))
    work = prompts * 2
    rng.shuffle(work)
    engine = _engine(path, block_size=8, num_kv_blocks=24, num_state_checkpoints=3, max_num_batched_tokens=24, max_num_seqs=3)
    for index, (prompt, images) in enumerate(work):
        engine.add_request(prompt, images=images, sampling_params=_greedy(5), request_id=str(index))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        assert_books_consistent(engine)
    stats = engine.stats()
    assert stats["kv_blocks_evicted"] > 0 and stats["state_checkpoints_evicted"] > 0 and stats["state_checkpoint_hits"] > 0
    plain = _engine(path, enable_prefix_caching=False)
    expected = plain.generate([p for p, _ in work], images=[i for _, i in work], sampling_params=_greedy(5), use_tqdm=False)
    assert [outputs[str(i)] for i in range(len(work))] == [o.token_ids for o in expected]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and engine.encoder_cache.num_referenced == 0
    states = engine.scheduler.states
    assert not states._live and not states._pending and states.num_cached_checkpoints <= 3
    states.audit()


def test_a_step_that_fails_midway_recomputes_its_requests_and_loses_nothing(path, monkeypatch):
    """The second linear layer raises once, after the first has advanced the states in place: running
    the step again would apply the first layer's update twice, so its requests recompute instead."""
    from mmengine.layers.gated_delta import GatedDeltaNet

    prompts = [qwen_vl_prompt(QUESTION, 1), qwen_vl_prompt("Something else entirely.", 0)]
    images = [PICTURES[:1], None]
    engine = _engine(path)
    victim = engine.runner.model.language_model.linear_layers()[1]
    calls = {"n": 0}
    original = GatedDeltaNet.forward

    def flaky(self, hidden, step):
        if self is victim:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected failure")
        return original(self, hidden, step)

    monkeypatch.setattr(GatedDeltaNet, "forward", flaky)
    for index, (prompt, pics) in enumerate(zip(prompts, images)):
        engine.add_request(prompt, images=pics, sampling_params=_greedy(6), request_id=str(index))
    outputs, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            results = engine.step()
        except RuntimeError:
            failures += 1
            assert_books_consistent(engine)
            continue
        outputs.update({o.request_id: o.token_ids for o in results if o.finished})
    assert failures == 1 and engine.scheduler.num_preemptions >= 1
    for index, (prompt, pics) in enumerate(zip(prompts, images)):
        assert outputs[str(index)] == hf_greedy(path, prompt, pics, 6, ignore_eos=True)


def test_the_budget_shows_what_a_recurrent_state_weighs(path, capsys):
    from mmengine.cli import main

    main(["budget", "--model", str(path), "--device", "cpu", "--max-num-seqs", "4"])
    shown = capsys.readouterr().out
    engine = _engine(path, max_num_seqs=4)
    per_state = engine.runner.state_slot_bytes
    assert per_state == 3 * (4 * 16 * 16 * 4 + 128 * 3 * 4)  # three linear layers: fp32 state + conv window
    assert f"one state (live or checkpoint) {per_state:>12}" in shown
    assert f"live states                   {5 * per_state:>12}" in shown  # four and the scratch slot
    assert engine.stats()["state_checkpoint_bytes"] == per_state
    assert engine.runner.recurrent_states[0].conv.shape[0] == 4 + engine.runner.num_state_checkpoints + 1
    # speculative decoding keeps a state before each draft of each live request
    main(["budget", "--model", str(path), "--device", "cpu", "--max-num-seqs", "4",
          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert f"draft states                  {4 * 3 * per_state:>12}" in capsys.readouterr().out
    engine = _engine(path, max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert engine.runner.recurrent_states[0].conv.shape[0] == 4 * (1 + 3) + engine.runner.num_state_checkpoints + 1


def test_decode_graph_steps_save_checkpoints_and_give_the_eager_tokens(path):
    """Decodes replay a graph (on CPU, the EagerCapturer stand-in) reading each row's live slot from a
    device buffer, padding rows writing a scratch slot; a decode that crosses a block boundary saves
    its trailing checkpoint after the replay, which the next turn resumes from."""
    from mmengine.runner.cuda_graphs import EagerCapturer

    prompts = [{"prompt_token_ids": [random.Random(i).randrange(10, 300) for _ in range(9 + 5 * i)]} for i in range(3)]
    results, hits = {}, {}
    for graphs in (False, True):
        engine = _engine(path, block_size=4, max_num_seqs=4)
        if graphs:
            engine.runner.capture_cuda_graphs(EagerCapturer())
        first = [o.token_ids for o in engine.generate(prompts, sampling_params=_greedy(9), use_tqdm=False)]
        follow = [{"prompt_token_ids": p["prompt_token_ids"] + t + [42]} for p, t in zip(prompts, first)]
        results[graphs] = first + [o.token_ids for o in engine.generate(follow, sampling_params=_greedy(3), use_tqdm=False)]
        hits[graphs] = engine.stats()["state_checkpoint_hits"], engine.stats()["prefill_tokens_computed"]
        if graphs:
            assert engine.runner.decode_graphs.num_replays >= 8
    assert results[True] == results[False]
    assert hits[True] == hits[False] and hits[True][0] == 3  # each follow-up resumed where its first turn's decode saved
