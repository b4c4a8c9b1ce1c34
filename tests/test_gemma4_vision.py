"""Gemma 4's image side against transformers: the tiny checkpoint, the processor without torchvision,
the vision encoder's soft tokens, and the items' token counts, resize rule and largest size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmengine.errors import UnsupportedModelError
from mmengine.models.gemma4_vision import (
    SUPPORTED_MAX_SOFT_TOKENS,
    Gemma4ImageItems,
    Gemma4VisionEncoder,
    load_gemma4_processor,
    vision_checkpoint_name,
)
from mmengine.testing.gemma4 import TinyGemma4Spec, build_tiny_gemma4, gemma4_prompt
from mmengine.testing.images import make_test_image

# (width, height): landscape and portrait of different aspect ratios
PICTURE_SIZES = [(64, 40), (30, 90)]


@pytest.fixture(scope="module")
def path(family_checkpoint) -> Path:
    return family_checkpoint("gemma4")


@pytest.fixture(scope="module")
def hf_model(path: Path):
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(path: Path):
    return load_gemma4_processor(str(path), {})


@pytest.fixture(scope="module")
def encoder(path: Path, hf_model) -> Gemma4VisionEncoder:
    encoder = Gemma4VisionEncoder(hf_model.config)
    tensors = {vision_checkpoint_name(name): t for name, t in load_file(path / "model.safetensors").items()}
    tensors.pop(None, None)
    encoder.load_state_dict(tensors, strict=True)
    return encoder.eval()


def pictures():
    return [make_test_image(seed, size) for seed, size in enumerate(PICTURE_SIZES)]


def hf_image_features(hf_model, batch) -> list[torch.Tensor]:
    with torch.inference_mode():
        return list(hf_model.model.get_image_features(batch["pixel_values"], batch["image_position_ids"]).pooler_output)


def test_checkpoint_reloads_in_transformers(path: Path) -> None:
    from transformers import Gemma4ForConditionalGeneration

    model, info = Gemma4ForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    spec, text = TinyGemma4Spec(), model.config.text_config
    assert text.layer_types == list(spec.layer_types) and text.layer_types[-1] == "full_attention"
    full = [i for i, kind in enumerate(spec.layer_types) if kind == "full_attention"]
    assert {i: (text.per_layer_config[i].head_dim, text.per_layer_config[i].num_key_value_heads) for i in full} == \
        {i: (spec.global_head_dim, spec.num_global_key_value_heads) for i in full}
    assert (text.attention_k_eq_v, text.num_kv_shared_layers, text.use_double_wide_mlp) == (True, 2, True)
    assert text.use_bidirectional_attention == "vision" and text.hidden_size_per_layer_input > 0
    assert model.config.audio_config is not None and model.config.vision_config.standardize
    state = model.state_dict()
    # the constants random init leaves at 1 (or +-inf) are drawn off it
    for name in ("model.language_model.layers.0.layer_scalar", "model.language_model.layers.0.input_layernorm.weight",
                 "model.vision_tower.std_scale", "model.vision_tower.encoder.layers.0.input_layernorm.weight"):
        assert not torch.all(state[name] == 1.0), name
    assert torch.isfinite(state["model.vision_tower.encoder.layers.0.mlp.up_proj.output_max"])


def test_moe_variant_without_audio_builds(tmp_path: Path) -> None:
    from transformers import Gemma4ForConditionalGeneration

    build_tiny_gemma4(tmp_path, TinyGemma4Spec(enable_moe_block=True, with_audio=False))
    model, info = Gemma4ForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert model.config.audio_config is None and model.config.text_config.enable_moe_block
    assert "model.language_model.layers.0.experts.gate_up_proj" in model.state_dict()
    assert load_gemma4_processor(str(tmp_path), {}).image_processor.max_soft_tokens == TinyGemma4Spec().max_soft_tokens


def test_processor_loads_without_torchvision(path: Path, processor) -> None:
    from transformers import Gemma4ImageProcessorPil, Gemma4Processor
    from transformers.utils import is_torchvision_available

    assert isinstance(processor, Gemma4Processor) and not hasattr(processor, "video_processor")
    assert type(processor.image_processor) is Gemma4ImageProcessorPil
    assert processor.image_processor.max_soft_tokens == TinyGemma4Spec().max_soft_tokens
    assert processor.chat_template and processor.tokenizer.image_token == "<|image|>"
    if not is_torchvision_available():  # what the loader works around
        from transformers import AutoProcessor

        with pytest.raises(Exception):  # its video processor needs torchvision
            AutoProcessor.from_pretrained(path)


def test_encoder_names_load_the_checkpoint(path: Path, hf_model) -> None:
    """Every vision tensor maps by prefix onto the encoder's state, all of it parameters (a loader of
    parameters fills the tower's clipping bounds and standardization too)."""
    encoder = Gemma4VisionEncoder(hf_model.config)
    ours = {vision_checkpoint_name(name) for name in load_file(path / "model.safetensors")} - {None}
    assert ours == set(encoder.state_dict()) == {name for name, _ in encoder.named_parameters()}


def test_encode_equals_transformers(processor, hf_model, encoder: Gemma4VisionEncoder) -> None:
    items = Gemma4ImageItems.from_image_processor(hf_model.config, processor.image_processor)
    batch = processor.image_processor(images=pictures(), return_tensors="pt")
    expected = hf_image_features(hf_model, batch)
    split = items.split_images(batch, 2)
    assert set(split[0]) == {"pixel_values", "image_position_ids"}
    together = encoder.encode(split)
    assert [t.shape for t in together] == [t.shape for t in expected] == \
        [(n, hf_model.config.text_config.hidden_size) for n in batch["num_soft_tokens_per_image"].tolist()]
    for ours, theirs in zip(together, expected):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(encoder.encode(split[1:])[0], expected[1], atol=1e-5, rtol=1e-5)  # alone as in a batch


def test_prompt_layout_and_token_counts(processor, hf_model) -> None:
    """Each `<|image|>` marker becomes <|image>, one <|image|> per soft token (mm_token_type_ids 1), <image|>;
    the rest of the prompt is tokenized as without the images."""
    config = hf_model.config
    items = Gemma4ImageItems.from_image_processor(config, processor.image_processor)
    prompt = gemma4_prompt("Compare them.", 2)
    out = processor(text=prompt, images=pictures(), return_tensors="pt")
    ids, types = out["input_ids"][0].tolist(), out["mm_token_type_ids"][0].tolist()
    batch = processor.image_processor(images=pictures(), return_tensors="pt")
    counts = [items.num_tokens(item) for item in items.split_images(batch, 2)]
    assert counts == batch["num_soft_tokens_per_image"].tolist()
    expected: list[int] = []
    images = iter(counts)
    for token in processor.tokenizer(prompt)["input_ids"]:
        expected += items.prompt_ids(next(images)) if token == items.image_token_id else [token]
    assert ids == expected
    assert (items.boi_token_id, items.image_token_id, items.eoi_token_id) == tuple(
        processor.tokenizer.convert_tokens_to_ids(["<|image>", "<|image|>", "<image|>"]))
    assert types == [int(token == items.image_token_id) for token in ids]
    assert ids.count(items.image_token_id) == sum(counts)


def test_resized_size_matches_processor(processor, hf_model) -> None:
    items = Gemma4ImageItems.from_image_processor(hf_model.config, processor.image_processor)
    ps = items.patch_size
    # (width, height): both orientations, a picture that makes exactly max_soft_tokens, extreme aspect ratios
    sizes = [*PICTURE_SIZES, (480, 336), (3, 400), (400, 3), (1000, 999), (17, 17)]
    for seed, (width, height) in enumerate(sizes):
        out = processor.image_processor(images=[make_test_image(seed, (width, height))], return_tensors="pt")
        real = out["image_position_ids"][0][(out["image_position_ids"][0] != -1).all(-1)]
        made = (int(real[:, 1].max() + 1) * ps, int(real[:, 0].max() + 1) * ps)
        assert items.resized_size(height, width) == made, (width, height)
        assert items.num_tokens(items.split_images(out, 1)[0]) == int(out["num_soft_tokens_per_image"][0])
    assert items.resized_size(336, 480) == (336, 480)  # 7 x 10 blocks: exactly max_soft_tokens


@pytest.mark.parametrize("max_soft_tokens", SUPPORTED_MAX_SOFT_TOKENS)
def test_no_image_exceeds_max_soft_tokens(hf_model, max_soft_tokens: int) -> None:
    items = Gemma4ImageItems(hf_model.config, {"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": max_soft_tokens})
    block = items.patch_size * items.pooling_kernel_size
    sides = [1, 2, 7, 16, 47, 48, 49, 100, 224, 333, 480, 640, 1000, 1080, 1920, 4000]
    tokens = []
    for height in sides:
        for width in sides:
            if max(height, width) / min(height, width) > 200:
                continue
            h, w = items.resized_size(height, width)
            assert h % block == 0 and w % block == 0
            tokens.append((h // block) * (w // block))
    assert max(tokens) <= items.max_tokens_by_modality()["image"] == max_soft_tokens
    # the dummy item's grid is an image's that makes exactly max_soft_tokens
    grid = items.dummy_items(1)[0]["image_position_ids"].max(dim=0).values + 1
    size = (int(grid[1]) * items.patch_size, int(grid[0]) * items.patch_size)
    assert items.resized_size(*size) == size and (size[0] // block) * (size[1] // block) == max_soft_tokens
    assert str(max_soft_tokens) in items.explain_max_tokens_per_item()


def test_dummy_items_are_the_largest(processor, hf_model, encoder: Gemma4VisionEncoder) -> None:
    items = Gemma4ImageItems.from_image_processor(hf_model.config, processor.image_processor)
    dummies = items.dummy_items(2)
    real = items.split_images(processor.image_processor(images=pictures(), return_tensors="pt"), 2)[0]
    assert [items.num_tokens(d) for d in dummies] == [items.max_soft_tokens] * 2
    assert all(d[name].shape == real[name].shape and d[name].dtype == real[name].dtype for d in dummies for name in real)
    assert [e.shape[0] for e in encoder.encode([dummies[0], real])] == [items.max_soft_tokens, items.num_tokens(real)]


def test_max_soft_tokens_override(path: Path, hf_model, encoder: Gemma4VisionEncoder) -> None:
    base = load_gemma4_processor(str(path), {})
    larger = load_gemma4_processor(str(path), {"max_soft_tokens": 140})
    items = Gemma4ImageItems.from_image_processor(hf_model.config, larger.image_processor)
    assert items.max_tokens_by_modality() == {"image": 140}
    batch = larger.image_processor(images=pictures(), return_tensors="pt")
    counts = [items.num_tokens(item) for item in items.split_images(batch, 2)]
    assert counts == batch["num_soft_tokens_per_image"].tolist()
    assert all(c > b for c, b in zip(counts, base.image_processor(images=pictures())["num_soft_tokens_per_image"]))
    assert all(c <= 140 for c in counts) and batch["pixel_values"].shape[1] == items.max_patches
    for ours, theirs in zip(encoder.encode(items.split_images(batch, 2)), hf_image_features(hf_model, batch)):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_processor_of_a_checkpoint_without_audio_settings(path: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(path / name, tmp_path / name)
    settings = json.loads((path / "processor_config.json").read_text())
    del settings["feature_extractor"]
    (tmp_path / "processor_config.json").write_text(json.dumps(settings))
    processor = load_gemma4_processor(str(tmp_path), {})
    assert processor.image_processor.max_soft_tokens == TinyGemma4Spec().max_soft_tokens
    assert processor(text=gemma4_prompt("Hi"))["input_ids"][0][0] == processor.tokenizer.bos_token_id


def test_settings_the_tower_cannot_take(hf_model) -> None:
    with pytest.raises(ValueError, match="max_soft_tokens"):
        Gemma4ImageItems(hf_model.config, {"patch_size": 16, "pooling_kernel_size": 3})
    with pytest.raises(UnsupportedModelError, match="patch_size"):
        Gemma4ImageItems(hf_model.config, {"patch_size": 14, "pooling_kernel_size": 3, "max_soft_tokens": 70})
    with pytest.raises(UnsupportedModelError, match="max_soft_tokens 100"):
        Gemma4ImageItems(hf_model.config, {"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 100})
