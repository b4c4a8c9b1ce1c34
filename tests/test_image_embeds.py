"""Precomputed image embeddings as items: transformers' own image features for a picture, passed as
{"image_embeds": ...} (with image_grid_thw for Qwen), give the greedy tokens transformers gives for the
picture, never run the tower, key the caches by their content, mix with pictures in one prompt, and
bad embeddings are refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_FP32, FamilyCase, _hf_model, hf_greedy
from mmengine import MMEngine, SamplingParams
from mmengine.errors import InvalidInputError
from mmengine.testing import make_test_image

PICTURES = [make_test_image(700 + i, size=size) for i, size in enumerate([(64, 48), (100, 60)])]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def hf_embeds(path, picture) -> dict:
    """transformers' image features for one picture, as an embeddings item."""
    model, processor = _hf_model(path, CPU_FP32)
    inputs = processor.image_processor(images=[picture], return_tensors="pt")
    with torch.inference_mode():
        features = model.get_image_features(**inputs)
    (embeds,) = features.pooler_output
    levels = getattr(features, "deepstack_features", None) or []  # Qwen3-VL: its DeepStack levels after the embedding
    embeds = torch.cat([embeds, *(level[0] for level in levels)], dim=-1)
    item = {"image_embeds": embeds.clone()}
    if "image_grid_thw" in inputs:
        item["image_grid_thw"] = inputs["image_grid_thw"][0]
    return item


@pytest.mark.parametrize("family_name", ["llava", "qwen2_5_vl", "qwen3_vl"])
def test_embeddings_give_the_pictures_tokens_without_the_tower(family_checkpoint, family_name):
    family = FamilyCase(family_name, family_checkpoint(family_name))
    prompt = family.prompt("Compare the two pictures.", 2)
    expected = hf_greedy(family.path, prompt, PICTURES, GREEDY.max_tokens, ignore_eos=True)
    engine = MMEngine(str(family.path), max_model_len=512, device="cpu", dtype="float32", enable_prefix_grouping=False)
    embeds = hf_embeds(family.path, PICTURES[0])
    (out,) = engine.generate(prompt, images=[embeds, PICTURES[1]], sampling_params=GREEDY, use_tqdm=False)
    assert out.token_ids == expected
    assert engine.stats()["encoder_runs"] == 1  # the picture only
    before = engine.stats()["prefill_tokens_computed"]
    again = engine.generate({"prompt": prompt, "multi_modal_data": {"image": [hf_embeds(family.path, PICTURES[0]), PICTURES[1]]}},
                            sampling_params=GREEDY, use_tqdm=False)
    computed = engine.stats()["prefill_tokens_computed"] - before
    cached = again[0].num_cached_tokens  # equal content: every full block hits (the default block size is 16)
    assert again[0].token_ids == expected and cached >= len(out.prompt_token_ids) - 16 and computed == len(out.prompt_token_ids) - cached
    assert engine.stats()["encoder_runs"] == 1




@pytest.mark.parametrize("family_name,change,match", [
    ("llava", lambda e: {"image_embeds": e["image_embeds"].to(torch.int32)}, "floating-point"),
    ("llava", lambda e: {"image_embeds": e["image_embeds"][:, :10]}, "hidden size 10"),
    ("llava", lambda e: {"image_embeds": e["image_embeds"].expand(2, -1, -1)}, "holds 2 images"),
    ("llava", lambda e: {"image_embeds": e["image_embeds"].clone().fill_(float("nan"))}, "non-finite"),
    ("llava", lambda e: {"image_embeds": e["image_embeds"][:5]}, "5 rows but the model gives this image 16"),
    ("llava", lambda e: {**e, "image_grid_thw": [1, 2, 2]}, "takes no image_grid_thw"),
    ("llava", lambda e: {**e, "pixel_values": 1}, r"unknown key\(s\) \['pixel_values'\]"),
    ("llava", lambda e: {"image_embeds": e["image_embeds"].to_sparse()}, "dense"),
    ("qwen2_5_vl", lambda e: {"image_embeds": e["image_embeds"]}, "need the picture's image_grid_thw"),
    ("qwen2_5_vl", lambda e: {**e, "image_grid_thw": [1, 4, 8]}, "rows but the model gives this image 8"),
])
def test_bad_embeddings_are_refused_by_name(family_checkpoint, family_name, change, match):
    family = FamilyCase(family_name, family_checkpoint(family_name))
    engine = MMEngine(str(family.path), max_model_len=512)
    item = change(hf_embeds(family.path, PICTURES[0]))
    with pytest.raises(InvalidInputError, match=match) as err:
        engine.generate([family.prompt("hi"), family.prompt("What is it?", 1)], images=[None, [item]], use_tqdm=False)
    assert err.value.prompt_index == 1 and not engine.has_unfinished_requests()
