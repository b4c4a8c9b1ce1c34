"""The loader reads both LLaVA checkpoint key layouts and rejects mismatching ones clearly."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from conftest import hf_greedy
from mmengine import MMEngine, SamplingParams
from mmengine.errors import UnsupportedModelError
from mmengine.testing import TinyLlavaSpec, make_test_image

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


def _rewrite(src, dst, rename):
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({rename(k): v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _original_llava_hf(name: str) -> str:
    """llava-hf's published layout: the vision tower nested under vision_model."""
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1) if name.startswith("vision_tower.") else name


def _transformers5_in_memory(name: str) -> str:
    """The layout transformers >= 4.52 uses in memory: model.language_model / model.vision_tower / lm_head."""
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


@pytest.mark.parametrize("rename", [_original_llava_hf, _transformers5_in_memory])
@pytest.mark.parametrize("spec", [TinyLlavaSpec(), TinyLlavaSpec(text_model="qwen2", vision_model="siglip", tie_word_embeddings=True, seed=1)])
def test_both_key_layouts_give_transformers_output(tmp_path, checkpoint_dir, exact_precision, rename, spec):
    path = _rewrite(checkpoint_dir(spec), tmp_path / "ckpt", rename)
    image = make_test_image(8)
    engine = MMEngine(str(path), max_model_len=256, **exact_precision.engine_kwargs)
    (out,) = engine.generate(PROMPT, images=[image], sampling_params=PARAMS, use_tqdm=False)
    assert out.token_ids == hf_greedy(checkpoint_dir(spec), PROMPT, [image], 8, exact_precision)


def test_tied_checkpoint_has_no_lm_head_and_still_loads(checkpoint_dir):
    path = checkpoint_dir(TinyLlavaSpec(text_model="qwen2", vision_model="siglip", tie_word_embeddings=True, seed=1))
    assert not any("lm_head" in k for k in load_file(str(path / "model.safetensors")))
    engine = MMEngine(str(path), max_model_len=256)
    model = engine.runner.model
    assert model.lm_head.weight.data_ptr() == model.language_model.embed_tokens.weight.data_ptr()


def test_wrong_shapes_and_unknown_tensors_are_rejected(tmp_path, checkpoint_dir):
    src = checkpoint_dir()
    extra = tmp_path / "extra"
    shutil.copytree(src, extra)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["language_model.model.mystery.weight"] = tensors["language_model.model.norm.weight"].clone()
    save_file(tensors, str(extra / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="mystery"):
        MMEngine(str(extra), max_model_len=256)

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["language_model.model.norm.weight"] = tensors["language_model.model.norm.weight"][:-1].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="norm.weight"):
        MMEngine(str(bad), max_model_len=256)
