"""Features that run at tensor_parallel_size=2 as at TP 1 (two spawned gloo ranks on CPU, fp32): update_weights (each
rank loads its part of every new weight; refusals raised on the driver, the engine still serving). The TP 2 engine
and its TP 1 reference share their options and run the same workloads, in order."""

from __future__ import annotations

import pytest
import torch

from helpers import tensor_parallel_pairs
from mmengine import SamplingParams
from mmengine.errors import WeightsMismatchError
from mmengine.testing import TinyLlavaSpec, make_test_image
from test_weight_update import perturbed

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=24, enable_prefix_grouping=False)
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
ASK = "USER: <image>\nWhat is shown here, in a few words? ASSISTANT:"
PICTURE = make_test_image(5, size=(64, 48))


@pytest.fixture(scope="module")
def pair(checkpoint_dir):
    """(checkpoint, TP 1 engine, TP 2 engine); two KV heads, one a rank."""
    with tensor_parallel_pairs({"llava": checkpoint_dir(TinyLlavaSpec(num_key_value_heads=2))}, **OPTIONS) as pairs:
        yield pairs["llava"]


def tokens(engine, prompts, images=None) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, images=images, sampling_params=GREEDY, use_tqdm=False)]


def test_update_weights_gives_tp1s_tokens_after_the_same_update(pair):
    path, one, two = pair
    before = tokens(two, [ASK], [[PICTURE]])
    weights = perturbed(path, seed=11)  # every weight: split, fused, vocabulary-parallel and replicated ones
    assert two.update_weights(weights) == one.update_weights(weights) > len(weights) // 2
    after = tokens(two, [ASK], [[PICTURE]])
    assert after == tokens(one, [ASK], [[PICTURE]]) and after != before
    name = "language_model.model.layers.0.self_attn.k_proj.weight"
    bad = {name: torch.zeros(1)}
    for engine in (one, two):
        with pytest.raises(WeightsMismatchError, match=rf"tensor '{name}' has shape \[1\], expected"):
            engine.update_weights(bad)
        with pytest.raises(WeightsMismatchError, match=r"unexpected tensor 'no.such.weight'"):
            engine.update_weights({"no.such.weight": torch.zeros(2)})
        with pytest.raises(WeightsMismatchError, match=rf"tensor '{name}' loads the same parameter"):
            engine.update_weights([(name, weights[name]), (name, weights[name])])
    assert tokens(two, [ASK], [[PICTURE]]) == tokens(one, [ASK], [[PICTURE]])  # still serving, the same weights
