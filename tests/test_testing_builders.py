"""Tests for mmengine.testing: tiny LLaVA checkpoints that transformers itself loads and runs."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoProcessor, AutoTokenizer, GenerationConfig, LlavaForConditionalGeneration
from transformers.utils import logging as hf_logging

import mmengine.testing.llava as mt
from mmengine.testing import TinyLlavaSpec, build_tiny_llava, make_test_image, tiny_llava_path
from mmengine.testing.weights import TINY_INITIALIZER_RANGE
from helpers import checkpoint_tensors

hf_logging.disable_progress_bar()

PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
ARCHS = [(t, v) for t in ("llama", "mistral", "qwen2") for v in ("clip", "siglip")]


def _load(path: pathlib.Path):
    return AutoProcessor.from_pretrained(path), LlavaForConditionalGeneration.from_pretrained(path).eval()


def _image_processor_class(processor) -> str:
    """The loaded image processor's class, backend suffix dropped: with torchvision installed
    AutoProcessor gives CLIPImageProcessor (torchvision backend), without it CLIPImageProcessorPil.
    Both are the same processor (same settings, same placeholder count); either is accepted."""
    return type(processor.image_processor).__name__.removesuffix("Pil")


def _saved_image_processor_type(path: pathlib.Path) -> str:
    """What the checkpoint itself names, whatever is installed where it is read."""
    return json.loads((path / "processor_config.json").read_text())["image_processor"]["image_processor_type"]


@pytest.fixture(scope="module")
def default_ckpt(tmp_path_factory) -> pathlib.Path:
    return build_tiny_llava(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="module")
def default_loaded(default_ckpt):
    return _load(default_ckpt)


# --- checkpoint contents -------------------------------------------------------------------------


def test_checkpoint_files(default_ckpt):
    names = {p.name for p in default_ckpt.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "chat_template.jinja",
    } <= names
    assert "model.safetensors.index.json" not in names


def test_config_consistent_with_tokenizer(default_ckpt):
    config = AutoConfig.from_pretrained(default_ckpt)
    tok = AutoTokenizer.from_pretrained(default_ckpt)
    spec = TinyLlavaSpec()
    text = config.text_config
    assert config.model_type == "llava" and text.model_type == "llama"
    assert config.vision_config.model_type == "clip_vision_model"
    assert text.vocab_size == len(tok) > spec.tokenizer_vocab_size  # BPE target + <image> + <pad>
    assert config.image_token_id == tok.convert_tokens_to_ids("<image>")
    assert config.image_seq_length == spec.num_image_tokens == 16
    assert config.vision_feature_layer == -2 and config.vision_feature_select_strategy == "default"
    assert config.projector_hidden_act == "gelu"
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (64, 128, 2)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (4, 2, 16)
    assert text.initializer_range == config.initializer_range == TINY_INITIALIZER_RANGE
    vision = config.vision_config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.image_size, vision.patch_size) == (32, 3, 32, 8)
    assert config.tie_word_embeddings is False and text.tie_word_embeddings is False
    ids = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert (text.bos_token_id, text.eos_token_id, text.pad_token_id) == ids
    gen = GenerationConfig.from_pretrained(default_ckpt)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == ids


def test_saved_weight_layout(default_ckpt):
    """transformers 5 saves LLaVA in the legacy llava-hf layout, but with CLIP's `vision_model.` level dropped."""
    keys = set(checkpoint_tensors(default_ckpt))
    assert "language_model.lm_head.weight" in keys
    assert "language_model.model.embed_tokens.weight" in keys
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in keys
    assert "language_model.model.norm.weight" in keys
    assert "vision_tower.embeddings.patch_embedding.weight" in keys
    assert "vision_tower.encoder.layers.2.self_attn.q_proj.weight" in keys
    assert "vision_tower.pre_layrnorm.weight" in keys
    assert {"multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_2.bias"} <= keys
    prefixes = ("language_model.model.", "language_model.lm_head.", "vision_tower.", "multi_modal_projector.")
    assert all(k.startswith(prefixes) for k in keys)
    assert not any(k.startswith("model.") or "vision_model" in k for k in keys)


def test_loaded_weights_match_files(default_ckpt, default_loaded):
    _, model = default_loaded
    saved = checkpoint_tensors(default_ckpt)
    assert model.lm_head.weight.dtype == torch.float32
    torch.testing.assert_close(model.lm_head.weight, saved["language_model.lm_head.weight"], rtol=0, atol=0)
    torch.testing.assert_close(
        model.model.vision_tower.encoder.layers[0].mlp.fc1.weight,
        saved["vision_tower.encoder.layers.0.mlp.fc1.weight"],
        rtol=0,
        atol=0,
    )
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in saved.values())
    assert not torch.equal(model.lm_head.weight, model.model.language_model.embed_tokens.weight)


def test_build_is_deterministic_and_seed_dependent(tmp_path, default_ckpt):
    again = build_tiny_llava(tmp_path / "again")
    for f in default_ckpt.iterdir():
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    other = build_tiny_llava(tmp_path / "other", TinyLlavaSpec(seed=1))
    assert (other / "tokenizer.json").read_bytes() == (default_ckpt / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (default_ckpt / "model.safetensors").read_bytes()


def test_build_preserves_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_llava(tmp_path / "m")
    assert torch.equal(torch.rand(4), expected)


# --- tokenizer, processor, chat template ---------------------------------------------------------


def test_tokenizer(default_ckpt):
    tok = AutoTokenizer.from_pretrained(default_ckpt)
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    image_id = tok.convert_tokens_to_ids("<image>")
    assert tok.padding_side == "left"
    ids = tok("USER: <image>\nWhat is in the image? ASSISTANT:").input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(image_id) == 1
    assert tok("<image><image>x<image>", add_special_tokens=False).input_ids.count(image_id) == 3
    text = "The quick brown fox, 42 apples & émigré café!"
    plain = tok(text, add_special_tokens=False).input_ids
    assert tok.bos_token_id not in plain
    assert tok.decode(plain) == text
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert len(tok("the image shows a house", add_special_tokens=False).input_ids) < len("the image shows a house") / 2


def test_processor_expands_image_tokens(default_ckpt, default_loaded):
    processor, model = default_loaded
    assert _image_processor_class(processor) == _saved_image_processor_type(default_ckpt) == "CLIPImageProcessor"
    inputs = processor(text=PROMPT, images=[make_test_image(0)], return_tensors="pt")
    ids = inputs["input_ids"][0]
    n = (ids == model.config.image_token_id).sum().item()
    assert n == (32 // 8) ** 2 == TinyLlavaSpec().num_image_tokens
    assert inputs["pixel_values"].shape == (1, 3, 32, 32)
    # The image tokens are contiguous and replace the single <image> marker.
    positions = (ids == model.config.image_token_id).nonzero().flatten()
    assert positions.tolist() == list(range(positions[0].item(), positions[0].item() + n))

    batch = processor(
        text=[PROMPT, "USER: <image>\nhi ASSISTANT:"],
        images=[make_test_image(1), make_test_image(2, (20, 64), "RGBA")],
        return_tensors="pt",
        padding=True,
    )
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    assert (batch["input_ids"] == model.config.image_token_id).sum(1).tolist() == [n, n]
    assert batch["attention_mask"][1, 0] == 0  # left padding
    assert batch["input_ids"][1, 0] == processor.tokenizer.pad_token_id


def test_chat_template(default_loaded):
    processor, _ = default_loaded
    render = processor.apply_chat_template
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    assert render([user], add_generation_prompt=True) == "USER: <image>\nWhat is this? ASSISTANT:"
    assert render([user]) == "USER: <image>\nWhat is this?"
    conversation = [
        {"role": "system", "content": "You are helpful."},
        user,
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": "And two?"},
        {"role": "assistant", "content": "Two cats."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "image"}]},
    ]
    assert render(conversation, add_generation_prompt=True) == (
        "You are helpful. USER: <image>\nWhat is this? ASSISTANT: A cat.</s>"
        "USER: And two? ASSISTANT: Two cats.</s>USER: Compare <image>\n<image>\n ASSISTANT:"
    )
    assert processor.chat_template == mt.CHAT_TEMPLATE
    with pytest.raises(Exception, match="unsupported role"):
        render([{"role": "tool", "content": "x"}])


def test_chat_template_tokenized_with_image(default_loaded):
    processor, model = default_loaded
    messages = [{"role": "user", "content": [{"type": "image", "image": make_test_image(5)}, {"type": "text", "text": "Hi"}]}]
    out = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    ids = out["input_ids"][0]
    assert ids[0] == processor.tokenizer.bos_token_id and (ids == processor.tokenizer.bos_token_id).sum() == 1
    assert (ids == model.config.image_token_id).sum() == 16
    assert processor.tokenizer.decode(ids, skip_special_tokens=True) == "USER: \nHi ASSISTANT:"


# --- generation ----------------------------------------------------------------------------------


def test_generate(default_loaded):
    processor, model = default_loaded
    inputs = processor(text=PROMPT, images=[make_test_image(0)], return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=5)
    prompt_len = inputs["input_ids"].shape[1]
    assert out.shape == (1, prompt_len + 5)
    assert torch.equal(out[0, :prompt_len], inputs["input_ids"][0])
    assert ((out[0, prompt_len:] >= 0) & (out[0, prompt_len:] < model.config.text_config.vocab_size)).all()
    assert torch.equal(model.generate(**inputs, do_sample=False, max_new_tokens=5), out)

    batch = processor(
        text=[PROMPT, PROMPT], images=[make_test_image(0), make_test_image(1)], return_tensors="pt", padding=True
    )
    batch_out = model.generate(**batch, do_sample=False, max_new_tokens=5)
    assert batch_out.shape == (2, batch["input_ids"].shape[1] + 5)


@pytest.mark.parametrize("spec", [TinyLlavaSpec(), TinyLlavaSpec("qwen2", "siglip", tie_word_embeddings=True)])
def test_greedy_is_well_defined_and_input_dependent(tmp_path, spec):
    """Greedy decoding must not hinge on near-ties, and must depend on the image (not one repeated token)."""
    processor, model = _load(build_tiny_llava(tmp_path / "m", spec))
    gaps, outputs = [], set()
    for seed in range(4):
        inputs = processor(text=PROMPT, images=[make_test_image(seed)], return_tensors="pt")
        out = model.generate(
            **inputs, do_sample=False, max_new_tokens=8, output_scores=True, return_dict_in_generate=True
        )
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            gaps.append((top2[0] - top2[1]).item())
        new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        outputs.add(tuple(new))
        assert len(set(new)) > 1
    assert min(gaps) > 1e-4
    assert float(np.median(gaps)) > 1e-2
    assert len(outputs) == 4


# --- architecture variants -----------------------------------------------------------------------


@pytest.mark.parametrize("text_model,vision_model", ARCHS)
def test_architectures_load_and_run(tmp_path, text_model, vision_model):
    spec = TinyLlavaSpec(text_model=text_model, vision_model=vision_model)
    path = build_tiny_llava(tmp_path / "m", spec)
    config = AutoConfig.from_pretrained(path)
    assert config.text_config.model_type == text_model
    assert config.vision_config.model_type == f"{vision_model}_vision_model"
    assert config.vision_feature_select_strategy == ("default" if vision_model == "clip" else "full")
    if text_model == "mistral":
        assert config.text_config.sliding_window is None
    processor, model = _load(path)
    expected = f"{'CLIP' if vision_model == 'clip' else 'Siglip'}ImageProcessor"
    assert _image_processor_class(processor) == _saved_image_processor_type(path) == expected
    keys = set(checkpoint_tensors(path))
    assert ("language_model.model.layers.0.self_attn.q_proj.bias" in keys) == (text_model == "qwen2")
    assert ("vision_tower.embeddings.class_embedding" in keys) == (vision_model == "clip")
    assert not any(".head." in k for k in keys)  # no SigLIP pooling head
    inputs = processor(text=PROMPT, images=[make_test_image(3)], return_tensors="pt")
    assert (inputs["input_ids"] == config.image_token_id).sum() == spec.num_image_tokens == 16
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()
    out = model.generate(**inputs, do_sample=False, max_new_tokens=3)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


@pytest.mark.parametrize("text_model", ["llama", "qwen2"])
def test_tied_embeddings(tmp_path, text_model):
    path = build_tiny_llava(tmp_path / "m", TinyLlavaSpec(text_model=text_model, tie_word_embeddings=True))
    keys = set(checkpoint_tensors(path))
    assert "language_model.lm_head.weight" not in keys
    assert "language_model.model.embed_tokens.weight" in keys
    config = AutoConfig.from_pretrained(path)
    assert config.tie_word_embeddings is True and config.text_config.tie_word_embeddings is True
    _, model = _load(path)
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()


def test_image_tokens_follow_strategy_and_feature_layers(tmp_path):
    spec = TinyLlavaSpec(vision_feature_select_strategy="full", vision_feature_layer=(-3, -1), head_dim=32)
    assert spec.num_image_tokens == 17  # CLS kept
    path = build_tiny_llava(tmp_path / "m", spec)
    config = AutoConfig.from_pretrained(path)
    assert config.vision_feature_layer == [-3, -1] and config.text_config.head_dim == 32
    keys = checkpoint_tensors(path)
    assert keys["multi_modal_projector.linear_1.weight"].shape == (64, 2 * 32)
    assert keys["language_model.model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    processor, model = _load(path)
    inputs = processor(text=PROMPT, images=[make_test_image(0)], return_tensors="pt")
    assert (inputs["input_ids"] == config.image_token_id).sum() == 17
    out = model.generate(**inputs, do_sample=False, max_new_tokens=2)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 2


def test_sharded_checkpoint(tmp_path, default_ckpt):
    path = build_tiny_llava(tmp_path / "sharded", max_shard_size="200KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((path / s).is_file() for s in shards)
    assert not (path / "model.safetensors").exists()
    sharded, single = checkpoint_tensors(path), checkpoint_tensors(default_ckpt)
    assert set(sharded) == set(single) == set(index["weight_map"])
    assert all(torch.equal(sharded[k], single[k]) for k in single)
    _, model = _load(path)
    assert torch.equal(model.lm_head.weight, single["language_model.lm_head.weight"])


def test_spec_validation():
    with pytest.raises(ValueError, match="text_model"):
        TinyLlavaSpec(text_model="gpt2")
    with pytest.raises(ValueError, match="vision_model"):
        TinyLlavaSpec(vision_model="vit")
    with pytest.raises(ValueError, match="strategy"):
        TinyLlavaSpec(vision_feature_select_strategy="cls")
    with pytest.raises(ValueError, match="multiple"):
        TinyLlavaSpec(image_size=30)
    assert TinyLlavaSpec(vision_model="siglip").select_strategy == "full"
    assert TinyLlavaSpec(vision_model="siglip", image_size=48).num_image_tokens == 36


# --- cache ---------------------------------------------------------------------------------------


def test_tiny_llava_path_caches(tmp_path, monkeypatch):
    first = tiny_llava_path(cache_dir=tmp_path)
    assert first.parent == tmp_path and (first / "model.safetensors").is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a cached checkpoint")

    monkeypatch.setattr(mt, "build_tiny_llava", fail)
    assert tiny_llava_path(cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    monkeypatch.setenv("MMENGINE_CACHE_DIR", str(tmp_path))
    assert tiny_llava_path() == first
    monkeypatch.undo()

    other = tiny_llava_path(TinyLlavaSpec(seed=1), cache_dir=tmp_path)
    assert other != first and other.parent == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])  # no temp dirs left
    assert LlavaForConditionalGeneration.from_pretrained(other).config.text_config.vocab_size > 0


def test_tiny_llava_path_lost_race(tmp_path, monkeypatch):
    """Another process finishing the same build first: its directory wins, ours is discarded."""
    spec = TinyLlavaSpec(text_model="qwen2")
    real_build = mt.build_tiny_llava
    winners = []

    def racing_build(path, spec):
        real_build(path, spec)
        monkeypatch.setattr(mt, "build_tiny_llava", real_build)
        winners.append(tiny_llava_path(spec, cache_dir=tmp_path))  # the "other process" renames first
        (winners[0] / "marker").write_text("winner")

    monkeypatch.setattr(mt, "build_tiny_llava", racing_build)
    result = tiny_llava_path(spec, cache_dir=tmp_path)
    assert result == winners[0]
    assert (result / "marker").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == [result.name]  # our temp dir was removed
    assert AutoConfig.from_pretrained(result).text_config.model_type == "qwen2"


def test_tiny_llava_path_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken_build(path, spec):
        (pathlib.Path(path) / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(mt, "build_tiny_llava", broken_build)
    with pytest.raises(RuntimeError, match="boom"):
        tiny_llava_path(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- family builders (FamilyBuilder) ------------------------------------------------------------


def test_a_family_builder_builds_its_default_spec_in_the_spec_dtype_unless_told(tmp_path):
    """InternVL's builder: no spec is the family's default (one cache entry), the weights are in the spec's dtype
    unless another is asked for, and the generation config stops at the family's tokens with its BOS."""
    from mmengine.testing.internvl import TinyInternVLSpec, build_internvl_checkpoint, tiny_internvl_path

    default = tiny_internvl_path(cache_dir=tmp_path / "cache")
    assert tiny_internvl_path(TinyInternVLSpec(), tmp_path / "cache") == default
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [default.name] and default.name.startswith("internvl-")
    half = build_internvl_checkpoint(tmp_path / "half", dtype="float16")
    assert {t.dtype for t in checkpoint_tensors(default).values()} == {torch.float32}
    assert {t.dtype for t in checkpoint_tensors(half).values()} == {torch.float16}
    tok, gen = AutoTokenizer.from_pretrained(half), GenerationConfig.from_pretrained(half)
    assert gen.eos_token_id == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert gen.bos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")


# --- images --------------------------------------------------------------------------------------


def test_make_test_image_deterministic_and_structured():
    a, b = make_test_image(7), make_test_image(7)
    assert a.mode == "RGB" and a.size == (48, 40)
    assert a.tobytes() == b.tobytes()
    assert a.tobytes() != make_test_image(8).tobytes()
    arr = np.asarray(a).astype(np.float32)
    assert arr.std() > 10 and len(np.unique(arr.reshape(-1, 3), axis=0)) > 50
    assert np.abs(np.diff(arr, axis=0)).mean() > 0.5 and np.abs(np.diff(arr, axis=1)).mean() > 0.5


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "CMYK", "P", "I", "F", "1"])
def test_make_test_image_modes(mode):
    img = make_test_image(3, (33, 17), mode)
    assert img.mode == mode and img.size == (33, 17)
    assert img.tobytes() == make_test_image(3, (33, 17), mode).tobytes()
    extrema = img.getextrema() if len(img.getbands()) > 1 else [img.getextrema()]
    assert all(lo != hi for lo, hi in extrema)  # every band varies
    if "A" in img.getbands():
        alpha = np.asarray(img.getchannel("A"))
        assert alpha.min() < alpha.max() and alpha.min() > 0
