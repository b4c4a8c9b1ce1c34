"""Start-up runs the vision tower at every image count a step can bring (cuDNN plans per input
shape; the first step with a new count paid for it on the request path), and books none of it."""

from __future__ import annotations

import pytest
import torch

from mmengine import MMEngine


def _spy_encoder(engine: MMEngine) -> list[int]:
    sizes: list[int] = []
    model = engine.runner.model
    encode = model.encode_items

    def spy(items):
        sizes.append(len(items))
        return encode(items)

    model.encode_items = spy
    return sizes


def test_a_fixed_size_family_warms_each_image_count_up_to_the_step_budget(family_checkpoint):
    engine = MMEngine(str(family_checkpoint("llava")), max_model_len=256, max_num_batched_tokens=64)
    budget = engine.encoder_budget
    per_step = budget.compute_budget_tokens // budget.max_tokens_per_item
    sizes = _spy_encoder(engine)
    assert engine.runner.warm_up_encoder(per_step) == list(range(1, per_step + 1)) == sizes
    assert per_step >= 2  # the case is not vacuous: several counts were run
    stats = engine.stats()
    assert stats["encoder_runs"] == 0 and stats["encoder_cache_entries"] == 0  # nothing was booked or cached


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_families_with_items_of_many_sizes_warm_nothing(family_checkpoint, name):
    engine = MMEngine(str(family_checkpoint(name)), max_model_len=256)
    sizes = _spy_encoder(engine)
    assert engine.runner.warm_up_encoder(4) == [] and sizes == []


def test_engine_start_up_warms_the_encoder_on_a_gpu_only(family_checkpoint, monkeypatch):
    """On a GPU the engine's own start-up runs the warm-up (checked here by spying on it); on CPU
    there is no per-shape setup to pay for and start-up skips it."""
    from mmengine.runner.model_runner import ModelRunner

    calls: list[int] = []
    real = ModelRunner.warm_up_encoder
    monkeypatch.setattr(ModelRunner, "warm_up_encoder", lambda self, n: calls.append(n) or real(self, n))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = MMEngine(str(family_checkpoint("llava")), device=device, max_model_len=256, max_num_batched_tokens=64)
    budget = engine.encoder_budget
    assert calls == ([budget.compute_budget_tokens // budget.max_tokens_per_item] if device == "cuda" else [])
