"""The vision tower runs only the encoder layers the feature selection reads, without the
post-layernorm and pooling head, and its image features still equal transformers'."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import CPU_FP32, _hf_model, hf_greedy
from mmengine import MMEngine, SamplingParams
from mmengine.testing import TinyLlavaSpec, make_test_image

IMAGES = [make_test_image(31), make_test_image(32, size=(30, 70))]
PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"

# (spec, encoder layers the tower should have); every spec's tower has 3 layers in the checkpoint
TOWERS = {
    "clip-layer-minus-2": (TinyLlavaSpec(), 2),
    "siglip-layer-minus-2": (TinyLlavaSpec(text_model="qwen2", vision_model="siglip", tie_word_embeddings=True, seed=1), 2),
    "clip-layers-minus-3-and-last": (TinyLlavaSpec(text_model="mistral", vision_model="clip", vision_feature_layer=(-3, -1), seed=2), 3),
    "clip-layers-embeddings-and-first": (TinyLlavaSpec(vision_feature_layer=(0, -3), seed=4), 1),
}


@pytest.mark.parametrize("name", list(TOWERS))
def test_tower_has_only_the_selected_layers_and_matches_transformers(checkpoint_dir, name):
    spec, num_layers = TOWERS[name]
    path = checkpoint_dir(spec)
    engine = MMEngine(str(path), max_model_len=256, **CPU_FP32.engine_kwargs)
    tower = engine.runner.model.vision_tower
    assert len(tower.encoder.layers) == num_layers
    assert isinstance(tower.post_layernorm, nn.Identity) and not hasattr(tower, "head")

    hf, processor = _hf_model(path, CPU_FP32)
    pixels = processor.image_processor(images=IMAGES, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        theirs = torch.stack(list(hf.model.get_image_features(pixel_values=pixels).pooler_output))
    torch.testing.assert_close(engine.runner.model.encode_images(pixels), theirs, rtol=1e-5, atol=1e-5)

    params = SamplingParams(max_tokens=8, temperature=0.0)
    (out,) = engine.generate(PROMPT, images=IMAGES[:1], sampling_params=params, use_tqdm=False)
    assert out.token_ids == hf_greedy(path, PROMPT, IMAGES[:1], 8)
