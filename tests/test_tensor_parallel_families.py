"""The dense families issue 48 names that tests/test_tensor_parallel.py does not start at TP 2: Qwen2.5-VL and
Qwen3-VL (M-RoPE, their vision towers replicated, deepstack for Qwen3-VL) and Qwen3.5 (the hybrid decoder: Gated
DeltaNet split by heads, gated attention). Each at TP 2 on two gloo ranks in fp32 gives TP 1's greedy tokens
(and transformers') with two pictures, a prefill chunked over steps and logprobs within 1e-4, and a repeat is a
prefix hit (at most one block computed, no encoder run; Qwen3.5 resumes from a state checkpoint). The three TP 2
engines start at once, in threads, while this process builds the TP 1 references."""

from __future__ import annotations

import pytest

import chat_formats
from conftest import CPU_FP32, hf_greedy
from helpers import tensor_parallel_pairs, wait_until
from mmengine import SamplingParams
from mmengine.testing import make_test_image

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 32}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=2)
PICTURES = [make_test_image(21), make_test_image(22, size=(64, 30))]


@pytest.fixture(scope="module")
def engines(family_checkpoint):
    """family -> (checkpoint, TP 1 engine, TP 2 engine)."""
    with tensor_parallel_pairs({family: family_checkpoint(family) for family in FAMILIES}, **OPTIONS) as pairs:
        yield pairs


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_gives_tp1_and_transformers_tokens_with_pictures_chunks_and_a_prefix_hit(engines, family):
    path, one, two = engines[family]
    prompt = chat_formats.user_turn(family, "Compare the pictures.", 2)
    (expected,) = one.generate(prompt, images=PICTURES, sampling_params=GREEDY, use_tqdm=False)
    (got,) = two.generate(prompt, images=PICTURES, sampling_params=GREEDY, use_tqdm=False)
    assert got.token_ids == expected.token_ids == hf_greedy(path, prompt, PICTURES, 8, CPU_FP32, ignore_eos=True)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(expected.logprobs, got.logprobs, strict=True)) < 1e-4
    assert len(got.prompt_token_ids) > OPTIONS["max_num_batched_tokens"]  # its prefill took several steps
    before = two.stats()
    (again,) = two.generate(prompt, images=PICTURES, sampling_params=GREEDY, use_tqdm=False)
    after = two.stats()
    assert again.token_ids == got.token_ids and after["encoder_runs"] == before["encoder_runs"]
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] <= 16
    if family == "qwen3_5":
        assert after["state_checkpoint_hits"] > before["state_checkpoint_hits"]


def test_a_rank_killed_while_idle_turns_the_engine_dead_without_a_call(engines):
    """(Last: it kills a module engine.) Noticed between steps: the engine's dead_error names the rank within
    seconds, so an AsyncMMEngine (a server's /health) is unhealthy before any request comes."""
    import os
    import signal

    from mmengine import AsyncMMEngine

    _, _, two = engines["qwen2_5_vl"]
    serving = AsyncMMEngine(two)
    assert serving.is_healthy and two.dead_error is None
    os.kill(two.parallel.executor.pids[1], signal.SIGKILL)
    assert wait_until(lambda: two.dead_error is not None, timeout_s=5) and "rank 1" in str(two.dead_error)
    assert not serving.is_healthy and serving.has_died
