"""Presence, frequency and repetition penalties (mmengine/sample/penalties.py): greedy tokens equal a
reference of OpenAI's rule (and transformers' repetition penalty) over transformers' logits (fp32
CPU), in a batch with unpenalized requests, with and without async scheduling; rows are given back."""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_FP32, _hf_inputs, _hf_model
from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError

# Text only: a penalty may well pick the image token, which transformers would take for a placeholder.
PROMPT = "USER: What is shown in the small picture? ASSISTANT:"


def _reference_tokens(model, inputs, steps: int, presence: float, frequency: float, repetition: float) -> list[int]:
    ids = inputs["input_ids"]
    prompt = set(ids[0].tolist())
    out: list[int] = []
    for _ in range(steps):
        with torch.inference_mode():
            logits = model(**{**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float() if out else torch.zeros_like(logits)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[list(prompt | set(out))] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        logits = logits - frequency * counts - presence * (counts > 0).float()
        token = int(logits.argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_penalized_greedy_tokens_equal_the_reference(checkpoint_dir, async_scheduling):
    path = checkpoint_dir()
    engine = MMEngine(str(path), max_model_len=256, device="cpu", dtype="float32", async_scheduling=async_scheduling)
    # A repetition penalty below 1 makes this random-weight model repeat itself; frequency and presence
    # penalties then pull it elsewhere, each in its own way.
    settings = [(0.0, 0.0, 1.0), (0.0, 0.0, 0.7), (0.0, 2.0, 0.7), (-1.0, 0.0, 1.0), (0.2, 0.1, 1.3)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, presence_penalty=p, frequency_penalty=f,
                             repetition_penalty=r) for p, f, r in settings]
    outs = engine.generate([PROMPT] * len(params), sampling_params=params, use_tqdm=False)
    model, processor = _hf_model(path, CPU_FP32)
    inputs = _hf_inputs(processor, PROMPT, None, CPU_FP32)
    expected = [_reference_tokens(model, inputs, 8, *s) for s in settings]
    assert [o.token_ids for o in outs] == expected
    assert len({tuple(e) for e in expected}) >= 4  # the penalties change the answer
    assert engine.runner.penalties.num_rows_in_use == 0


def test_penalties_are_checked():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(repetition_penalty=float("nan"))):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_logit_bias_moves_the_greedy_choice(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, device="cpu", dtype="float32")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (plain,) = engine.generate(PROMPT, sampling_params=greedy, use_tqdm=False)
    forced, banned, unbiased = engine.generate(
        [PROMPT] * 3, use_tqdm=False,
        sampling_params=[SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={42: 100}),
                         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={plain.token_ids[0]: -100}),
                         greedy])
    assert forced.token_ids == [42] * 4
    assert banned.token_ids[0] != plain.token_ids[0]
    assert unbiased.token_ids == plain.token_ids  # its neighbours' biases stay in their rows
    with pytest.raises(ConfigError, match="logit_bias names token"):
        engine.generate(PROMPT, sampling_params=SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    with pytest.raises(ConfigError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})
