"""Logits agree closely with transformers, not just the argmax."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_logits
from mmengine import MMEngine, SamplingParams
from mmengine.testing import TinyLlavaSpec, make_test_image


@pytest.mark.parametrize("spec", [TinyLlavaSpec(), TinyLlavaSpec(text_model="qwen2", vision_model="siglip", seed=1)])
@pytest.mark.parametrize("chunk", [2048, 5])
def test_prefill_logits_match_transformers(checkpoint_dir, spec, chunk):
    path = checkpoint_dir(spec)
    engine = MMEngine(str(path), max_model_len=256, max_num_batched_tokens=chunk, block_size=8)
    captured: list[torch.Tensor] = []
    compute_logits = engine.runner.model.compute_logits
    engine.runner.model.compute_logits = lambda h: captured.append(compute_logits(h)) or captured[-1]

    prompt, images = "USER: <image>\nWhat is in the picture? ASSISTANT:", [make_test_image(3)]
    engine.generate(prompt, images=images, sampling_params=SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

    ours = captured[0][0]
    reference = hf_logits(path, prompt, images)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    assert reference.std() > 1e-3  # the comparison is not between two flat vectors
