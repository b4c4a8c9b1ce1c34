"""Logits agree closely with transformers, not just the argmax: in fp32 tightly, and in bf16 within a
tolerance against transformers in bf16, each on CPU and (when one is present) on a GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import Precision, hf_logits
from mmengine import MMEngine, SamplingParams
from mmengine.testing import TinyLlavaSpec, make_test_image

# bf16 against bf16: the same rounded weights, different kernels and summation orders. Measured on CPU
# (logits of spread ~1.6, magnitude up to ~5): mmengine vs transformers, both bf16, differ by at most
# 0.055 (mean 0.012); transformers' own bf16 error against fp32 is up to 0.16 (mean 0.043), so two
# independent bf16 implementations may differ by ~0.23 (mean ~0.06). A real fault moves logits by ~1
# (a different image: max 6.3, mean 1.5), far outside these bounds.
BF16_MAX_ABS = 0.4
BF16_MEAN_ABS = 0.1


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor, precision: Precision) -> None:
    ours = ours.float()
    if precision.exact:
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
        return
    diff = (ours - reference).abs()
    assert diff.max() <= BF16_MAX_ABS and diff.mean() <= BF16_MEAN_ABS, (diff.max().item(), diff.mean().item())


@pytest.mark.parametrize("spec", [TinyLlavaSpec(), TinyLlavaSpec(text_model="qwen2", vision_model="siglip", seed=1)])
@pytest.mark.parametrize("chunk", [2048, 5])
def test_prefill_logits_match_transformers(checkpoint_dir, precision, spec, chunk):
    path = checkpoint_dir(spec)
    engine = MMEngine(str(path), max_model_len=256, max_num_batched_tokens=chunk, block_size=8, **precision.engine_kwargs)
    captured: list[torch.Tensor] = []
    compute_logits = engine.runner.model.compute_logits
    engine.runner.model.compute_logits = lambda h: captured.append(compute_logits(h)) or captured[-1]

    prompt, images = "USER: <image>\nWhat is in the picture? ASSISTANT:", [make_test_image(3)]
    engine.generate(prompt, images=images, sampling_params=SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

    ours = captured[0][0]
    reference = hf_logits(path, prompt, images, precision)
    assert_logits_close(ours, reference, precision)
    assert reference.std() > 1e-3  # the comparison is not between two flat vectors


def test_the_bf16_tolerance_catches_a_wrong_image(checkpoint_dir):
    """The bf16 criterion is tight enough to fail when the image is wrong (checked on CPU in fp32,
    where the two references differ only by the image)."""
    path = checkpoint_dir()
    prompt = "USER: <image>\nWhat is in the picture? ASSISTANT:"
    right, wrong = hf_logits(path, prompt, [make_test_image(3)]), hf_logits(path, prompt, [make_test_image(4)])
    with pytest.raises(AssertionError):
        assert_logits_close(wrong, right, Precision("cuda", torch.bfloat16))
