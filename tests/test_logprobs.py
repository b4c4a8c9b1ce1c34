"""Log-probabilities of generated tokens (SamplingParams(logprobs=k)): raw log_softmax of the model's
logits, equal to transformers' at every position (fp32), the top-k best first, the same with async
scheduling, and None when not asked for."""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_FP32, _hf_inputs, _hf_model
from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError
from mmengine.testing import make_test_image

PROMPT = "USER: <image>\nWhat is shown? ASSISTANT:"
PICTURE = make_test_image(5, size=(64, 48))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_logprobs_equal_transformers_log_softmax(checkpoint_dir, async_scheduling):
    path = checkpoint_dir()
    engine = MMEngine(str(path), max_model_len=256, device="cpu", dtype="float32", async_scheduling=async_scheduling)
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]
    outs = engine.generate([PROMPT] * 3, images=[[PICTURE]] * 3, sampling_params=params, use_tqdm=False)
    model, processor = _hf_model(path, CPU_FP32)
    inputs = _hf_inputs(processor, PROMPT, [PICTURE], CPU_FP32)
    for out in outs[:2]:
        ids = torch.cat([inputs["input_ids"], torch.tensor([out.token_ids[:-1]])], dim=1)
        with torch.inference_mode():
            logits = model(**{**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}).logits[0]
        expected = logits[-len(out.token_ids):].float().log_softmax(-1)
        assert [entry.token_id for entry in out.logprobs] == out.token_ids
        for position, entry in enumerate(out.logprobs):
            assert entry.logprob == pytest.approx(expected[position, entry.token_id].item(), abs=1e-4)
            best = expected[position].topk(len(entry.top))
            assert [token for token, _ in entry.top] == best.indices.tolist()
            assert [value for _, value in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert len(outs[0].logprobs[0].top) == 3 and outs[0].logprobs[0].top[0][0] == outs[0].token_ids[0]  # greedy: the best
    assert outs[1].logprobs[0].top == []
    assert outs[2].logprobs is None


def test_logprobs_is_checked():
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=1000)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_prompt_logprobs_equal_transformers_over_chunks(checkpoint_dir, async_scheduling):
    path = checkpoint_dir()
    # a small token budget splits the prompt (and its picture) over several steps
    engine = MMEngine(str(path), max_model_len=256, device="cpu", dtype="float32", async_scheduling=async_scheduling,
                      max_num_batched_tokens=16)
    (warm,) = engine.generate(PROMPT, images=[PICTURE], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    (out,) = engine.generate(PROMPT, images=[PICTURE], sampling_params=params, use_tqdm=False)
    assert out.num_cached_tokens == 0  # the cached prefix is not read: its positions must be computed
    model, processor = _hf_model(path, CPU_FP32)
    inputs = _hf_inputs(processor, PROMPT, [PICTURE], CPU_FP32)
    with torch.inference_mode():
        expected = model(**inputs).logits[0].float().log_softmax(-1)
    ids = inputs["input_ids"][0].tolist()
    assert out.prompt_token_ids == ids and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        entry = out.prompt_logprobs[position]
        assert entry.token_id == ids[position]
        assert entry.logprob == pytest.approx(expected[position - 1, ids[position]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == expected[position - 1].topk(2).indices.tolist()
    assert warm.prompt_logprobs is None
