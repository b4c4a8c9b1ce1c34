"""Qwen3-VL specifics beyond the family-wide tests (conftest.FAMILIES runs every engine test on it):
logits equal transformers' with DeepStack and interleaved M-RoPE, DeepStack levels past the first
layers of a deeper decoder, and the encoder cache holding (and counting) every level."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import CPU_FP32, _hf_inputs, _hf_model, hf_greedy
from mmengine import MMEngine, SamplingParams
from mmengine.testing import make_test_image
from mmengine.testing.qwen_vl import TinyQwenVLSpec, qwen_vl_prompt, tiny_qwen_vl_path

PICTURES = [make_test_image(21, size=(96, 96)), make_test_image(22, size=(64, 160))]


@pytest.fixture(scope="module")
def path():
    return tiny_qwen_vl_path(TinyQwenVLSpec(family="qwen3_vl"))


def test_logits_equal_transformers_with_two_pictures(path):
    prompt = qwen_vl_prompt("Compare them.", 2)
    engine = MMEngine(str(path), device="cpu", dtype="float32")
    (out,) = engine.generate(prompt, images=PICTURES, sampling_params=SamplingParams(max_tokens=1, temperature=0, logprobs=8),
                             use_tqdm=False)
    model, processor = _hf_model(path, CPU_FP32)
    with torch.inference_mode():
        expected = model(**_hf_inputs(processor, prompt, PICTURES, CPU_FP32)).logits[0, -1].float().log_softmax(-1)
    for token, value in out.logprobs[0].top:
        assert value == pytest.approx(expected[token].item(), abs=1e-5)


def test_the_encoder_cache_holds_every_deepstack_level(path):
    engine = MMEngine(str(path), device="cpu", dtype="float32")
    family = engine.family
    assert family.deepstack_levels == 2 and family.embedding_width == 3 * family.text_config.hidden_size
    assert engine.runner.embedding_bytes == family.embedding_width * 4
    engine.generate(qwen_vl_prompt("What is it?", 1), images=PICTURES[:1], sampling_params=SamplingParams(max_tokens=2),
                    use_tqdm=False)
    (entry,) = engine.runner.encoder_outputs.values()
    assert entry.shape[1] == family.embedding_width
    budget = subprocess.run([sys.executable, "-m", "mmengine", "budget", "--model", str(path), "--device", "cpu"],
                            capture_output=True, text=True, check=True).stdout
    assert "2 DeepStack levels" in budget


def test_deepstack_levels_stop_after_their_layers_in_a_deeper_decoder(tmp_path):
    """Three decoder layers and two levels: the third layer adds nothing."""
    path = tiny_qwen_vl_path(TinyQwenVLSpec(family="qwen3_vl", num_hidden_layers=3, deepstack_visual_indexes=(1, 2)),
                             cache_dir=tmp_path)
    prompt = qwen_vl_prompt("Describe the picture.", 1)
    engine = MMEngine(str(path), device="cpu", dtype="float32")
    (out,) = engine.generate(prompt, images=PICTURES[1:], sampling_params=SamplingParams(max_tokens=8, temperature=0),
                             use_tqdm=False)
    assert out.token_ids == hf_greedy(path, prompt, PICTURES[1:], 8)
