"""A placeholder token the model generates (no picture, video or clip behind it) is embedded as transformers
embeds it. Gemma 4 reads the pad token's row for each of `<|image|>`, `<|video|>` and `<|audio|>` (its
forward masks every placeholder with get_placeholder_mask and embeds the pad id in its place); LLaVA's
`<image>` and Qwen's `<|image_pad|>` / `<|video_pad|>` embed as their own rows (their forwards only scatter
an item's features over its placeholders, and a decode step has none). Each placeholder is made the first
generated token by a logit_bias just large enough to win there (the same bias on both sides, on every
step); the greedy tokens and every step's top logprobs then equal transformers' generate (fp32 CPU)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import CPU_FP32, FamilyCase, _hf_inputs, _hf_model
from mmengine import MMEngine, SamplingParams
from mmengine.testing.gemma4 import gemma4_prompt

MAX_TOKENS = 6
TOP = 5
TEXT = "Tell me about the boats on the river."
CASES = [("gemma4", "image_token_id"), ("gemma4", "video_token_id"), ("gemma4", "audio_token_id"),
         ("llava", "image_token_id"), ("qwen3_vl", "image_token_id"), ("qwen3_vl", "video_token_id"),
         ("qwen3_5", "image_token_id")]


class _Bias(LogitsProcessor):
    def __init__(self, token: int, bias: float) -> None:
        self.token, self.bias = token, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.token] += self.bias
        return scores


@functools.cache
def _engine(path) -> MMEngine:
    return MMEngine(str(path), device="cpu", dtype="float32", max_model_len=256, enforce_eager=True)


@pytest.mark.parametrize("name, placeholder", CASES)
def test_a_generated_placeholder_is_embedded_as_transformers_does(family_checkpoint, name, placeholder):
    path = family_checkpoint(name)
    prompt = gemma4_prompt(TEXT) if name == "gemma4" else FamilyCase(name, path).prompt(TEXT)
    model, processor = _hf_model(path, CPU_FP32)
    token = getattr(model.config, placeholder)
    inputs = _hf_inputs(processor, prompt, None, CPU_FP32)
    with torch.inference_mode():
        first = model(**inputs).logits[0, -1].float()
        bias = float(first.max() - first[token]) + 0.5  # the placeholder wins the first step by 0.5
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, output_scores=True,
                             return_dict_in_generate=True, logits_processor=LogitsProcessorList([_Bias(token, bias)]))
    expected = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias={token: bias}, logprobs=TOP)
    (output,) = _engine(path).generate(prompt, sampling_params=params, use_tqdm=False)
    assert expected[0] == token
    assert output.token_ids == expected
    for step, (entry, scores) in enumerate(zip(output.logprobs, out.scores)):
        reference = scores[0].float().log_softmax(-1)
        for top_token, value in entry.top:
            assert value == pytest.approx(reference[top_token].item(), abs=1e-4), (step, top_token)
        assert [value for _, value in entry.top] == pytest.approx(reference.topk(TOP).values.tolist(), abs=1e-4)
