"""Beam search: the sequences of transformers' generate(num_beams=W, num_return_sequences=W) on the
tiny checkpoints, best first, with its scores; the beams share the prompt's blocks and the picture's
encoder output (one tower run, the prompt prefilled once whatever the width)."""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_FP32, FamilyCase, _hf_inputs, _hf_model
from mmengine import BeamSearchParams, MMEngine, SamplingParams
from mmengine.errors import ConfigError
from mmengine.testing import make_test_image

PICTURE = make_test_image(808, size=(64, 48))


def hf_beams(path, prompt, images, width, max_tokens, length_penalty=1.0):
    model, processor = _hf_model(path, CPU_FP32)
    inputs = _hf_inputs(processor, prompt, images, CPU_FP32)
    with torch.inference_mode():
        out = model.generate(**inputs, num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                             eos_token_id=None, early_stopping=False, length_penalty=length_penalty,
                             return_dict_in_generate=True, output_scores=True)
    start = inputs["input_ids"].shape[1]
    return [seq[start:].tolist() for seq in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("family_name,width", [("llava", 2), ("llava", 4), ("qwen2_5_vl", 3), ("qwen3_5", 3), ("qwen3_vl_moe", 2)])
def test_beam_search_matches_transformers(family_checkpoint, family_name, width):
    family = FamilyCase(family_name, family_checkpoint(family_name))
    prompt = family.prompt("Describe the picture.", 1)
    expected, scores = hf_beams(family.path, prompt, [PICTURE], width, 5)
    engine = MMEngine(str(family.path), max_model_len=512, device="cpu", dtype="float32", block_size=8)
    (out,) = engine.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=True), images=[PICTURE])
    assert [s.token_ids for s in out.sequences] == expected
    assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4)
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([x * 5 for x in scores], abs=1e-3)
    stats = engine.stats()
    assert stats["encoder_runs"] == 1  # one tower run for the picture, whatever the width
    # the prompt once; then each beam step only its tokens past its last full block (block size 8)
    assert stats["prefill_tokens_computed"] < len(out.prompt_token_ids) + 5 * width * 8
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_beam_search_params_are_checked():
    with pytest.raises(ConfigError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ConfigError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beams_that_end_in_eos_match_transformers(family_checkpoint, length_penalty):
    """With a frequent token as the EOS, some beams finish early: the finished hypotheses, their
    length-penalized scores and the stopping rule are transformers'."""
    family = FamilyCase("llava", family_checkpoint("llava"))
    prompt = family.prompt("Describe the picture.", 1)
    engine = MMEngine(str(family.path), max_model_len=512, device="cpu", dtype="float32")
    (greedy,) = engine.generate(prompt, images=[PICTURE], sampling_params=SamplingParams(max_tokens=6, temperature=0.0,
                                                                                          ignore_eos=True), use_tqdm=False)
    eos = greedy.token_ids[2]  # a token the beams meet within a few steps
    engine.eos_token_ids = frozenset({eos})
    model, processor = _hf_model(family.path, CPU_FP32)
    inputs = _hf_inputs(processor, prompt, [PICTURE], CPU_FP32)
    with torch.inference_mode():
        out = model.generate(**inputs, num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=6,
                             eos_token_id=eos, pad_token_id=eos, early_stopping=False, length_penalty=length_penalty,
                             return_dict_in_generate=True, output_scores=True)
    start = inputs["input_ids"].shape[1]
    expected = []
    for seq in out.sequences:
        tokens = seq[start:].tolist()
        expected.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    (result,) = engine.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=length_penalty),
                                   images=[PICTURE])
    assert any(seq.token_ids[-1] == eos for seq in result.sequences)
    assert [s.token_ids for s in result.sequences] == expected
    assert [s.score for s in result.sequences] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
