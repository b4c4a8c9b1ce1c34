"""Quantized checkpoints at tensor_parallel_size=2 (issue 48): an FP8 block-scaled and a W4A16 group-quantized
LLaVA, each rank dequantizing the weights with their scales (and zeros) and keeping its part, give TP 1's greedy
tokens and log-probabilities within 1e-4 in fp32, with a picture and a prefix hit. Both TP 2 engines start at once,
in threads, while this process builds the TP 1 references."""

from __future__ import annotations

import pytest

from helpers import tensor_parallel_pairs
from mmengine import SamplingParams
from mmengine.testing import make_test_image
from mmengine.testing.quantize import quantize_checkpoint

METHODS = ("fp8", "w4a16")
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 32}
PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
PICTURE = make_test_image(43, size=(64, 48))
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=2)


@pytest.fixture(scope="module")
def quantized(family_checkpoint, tmp_path_factory):
    """method -> (its checkpoint, TP 1 engine, TP 2 engine)."""
    source = family_checkpoint("llava")
    root = tmp_path_factory.mktemp("tp-quantized")
    paths = {method: quantize_checkpoint(source, root / method, method, reference=False)[0] for method in METHODS}
    with tensor_parallel_pairs(paths, **OPTIONS) as pairs:
        yield pairs


@pytest.mark.parametrize("method", METHODS)
def test_a_quantized_checkpoint_at_tp2_gives_tp1s_tokens(quantized, method):
    _, one, two = quantized[method]
    (reference,) = one.generate(PROMPT, images=[PICTURE], sampling_params=GREEDY, use_tqdm=False)
    for attempt in range(2):  # the second a prefix hit: at most one block computed, no encoder run
        runs = two.stats()["encoder_runs"]
        (out,) = two.generate(PROMPT, images=[PICTURE], sampling_params=GREEDY, use_tqdm=False)
        assert out.token_ids == reference.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(reference.logprobs, out.logprobs, strict=True)) < 1e-4
        if attempt:
            assert out.num_cached_tokens >= len(out.prompt_token_ids) - 16 and two.stats()["encoder_runs"] == runs
