"""On a GPU, one-size items (LLaVA) go through the vision tower in batches padded to a power of
two, and start-up runs the tower once at each of those sizes: cuDNN plans per input shape, and the
first step with a new image count used to pay for that on the request path. Padding changes no
embedding and no count; nothing of the warm-up is booked. On CPU the same logic runs when turned on."""

from __future__ import annotations

import pytest
import torch

from mmengine import MMEngine, SamplingParams
from mmengine.runner.encoder_runs import encoder_batch_size
from mmengine.testing import make_test_image


def _spy_encoder(engine: MMEngine) -> list[int]:
    sizes: list[int] = []
    model = engine.runner.model
    encode = model.encode_items

    def spy(items):
        sizes.append(len(items))
        return encode(items)

    model.encode_items = spy
    return sizes


def test_padded_batch_sizes_are_powers_of_two():
    assert [encoder_batch_size(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]


def test_start_up_warms_each_padded_batch_size_up_to_the_step_budget(family_checkpoint):
    engine = MMEngine(str(family_checkpoint("llava")), max_model_len=256, max_num_batched_tokens=64)
    engine.runner.pad_encoder_batches = True  # what a GPU does (CPU plans nothing per shape)
    budget = engine.encoder_budget
    per_step = budget.compute_budget_tokens // budget.max_tokens_per_item
    assert per_step == 5  # 64 tokens of 16-token images, plus one: so sizes 1, 2, 4 and 8
    sizes = _spy_encoder(engine)
    assert engine.runner.warm_up_encoder(per_step) == [1, 2, 4, 8] == sizes
    stats = engine.stats()
    assert stats["encoder_runs"] == 0 and stats["encoder_cache_entries"] == 0  # nothing was booked or cached


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_families_with_items_of_many_sizes_neither_pad_nor_warm(family_checkpoint, name):
    engine = MMEngine(str(family_checkpoint(name)), max_model_len=256)
    assert not engine.runner.pad_encoder_batches  # on a GPU too: their shapes are not known ahead
    sizes = _spy_encoder(engine)
    engine.runner.pad_encoder_batches = False
    assert engine.runner.warm_up_encoder(4) == [] and sizes == []


def test_a_padded_batch_gives_the_same_tokens_and_counts(family_checkpoint):
    prompts = [f"USER: <image>\nWhat is picture {i}? ASSISTANT:" for i in range(3)]
    images = [[make_test_image(30 + i, size=(64, 48))] for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = {}
    for pad in (False, True):
        engine = MMEngine(str(family_checkpoint("llava")), max_model_len=256, dtype="float32")
        engine.runner.pad_encoder_batches = pad
        sizes = _spy_encoder(engine)
        outputs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
        runs[pad] = ([o.token_ids for o in outputs], engine.stats()["encoder_runs"], sizes)
    assert runs[False][2] == [3] and runs[True][2] == [4]  # the three pictures in one step, padded with one
    assert runs[True][:2] == runs[False][:2] and runs[True][1] == 3  # the padding is neither kept nor counted


def test_each_cached_embedding_owns_its_memory(family_checkpoint):
    """A cached item must not be a view into its step's batch: that would keep the whole batch
    (padding included) alive while any one item of it stays cached, beyond the cache's count."""
    engine = MMEngine(str(family_checkpoint("llava")), max_model_len=256, dtype="float32")
    engine.runner.pad_encoder_batches = True
    prompts = [f"USER: <image>\nWhat is picture {i}? ASSISTANT:" for i in range(3)]
    images = [[make_test_image(40 + i, size=(64, 48))] for i in range(3)]
    engine.generate(prompts, images=images, sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    outputs = list(engine.runner.encoder_outputs.values())
    assert len(outputs) == 3
    assert all(o.untyped_storage().nbytes() == o.numel() * o.element_size() for o in outputs)


def test_engine_start_up_warms_the_encoder_on_a_gpu_only(family_checkpoint, monkeypatch):
    from mmengine.runner.model_runner import ModelRunner

    calls: list[list[int]] = []
    real = ModelRunner.warm_up_encoder
    monkeypatch.setattr(ModelRunner, "warm_up_encoder", lambda self, n: calls.append(real(self, n)) or calls[-1])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = MMEngine(str(family_checkpoint("llava")), device=device, max_model_len=256, max_num_batched_tokens=64)
    assert engine.runner.pad_encoder_batches == (device == "cuda")
    assert calls == ([[1, 2, 4, 8]] if device == "cuda" else [[]])
