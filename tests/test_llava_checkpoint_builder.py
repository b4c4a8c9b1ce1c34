"""mmengine.testing.build_llava_checkpoint: random-weight checkpoints of any shape, on any device, in
any dtype, at the real models' weight scale; LLAVA_1_5_7B_SPEC is the published model's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoProcessor, LlavaForConditionalGeneration

import mmengine.testing.llava as mt
from mmengine import MMEngine, SamplingParams
from mmengine.models.loader import checkpoint_dtype
from mmengine.testing import LLAVA_1_5_7B_SPEC, REAL_INITIALIZER_RANGE, TinyLlavaSpec, build_llava_checkpoint, make_test_image

SMALL = TinyLlavaSpec(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                      vision_hidden_size=64, vision_intermediate_size=128, image_size=28, patch_size=14, vocab_size=600)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    return build_llava_checkpoint(tmp_path_factory.mktemp("bf16") / "m", SMALL, dtype="bfloat16")


def test_the_7b_spec_has_the_published_shape():
    """7,063,427,072 parameters like llava-hf/llava-1.5-7b-hf (counted on the meta device: no memory)."""
    tokenizer = mt._build_tokenizer(LLAVA_1_5_7B_SPEC.tokenizer_vocab_size)
    config = mt._build_config(LLAVA_1_5_7B_SPEC, tokenizer, REAL_INITIALIZER_RANGE)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads) == (4096, 11008, 32, 32)
    assert (text.num_key_value_heads, text.vocab_size, text.max_position_embeddings) == (32, 32064, 4096)
    assert (vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers, vision.num_attention_heads) == (1024, 4096, 24, 16)
    assert (vision.image_size, vision.patch_size, config.vision_feature_layer) == (336, 14, -2)
    assert text.initializer_range == vision.initializer_range == 0.02
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 7_063_427_072

    processor = mt._build_processor(LLAVA_1_5_7B_SPEC, tokenizer)
    inputs = processor(text="USER: <image>\nWhat is this? ASSISTANT:", images=[make_test_image(0, (640, 480))], return_tensors="pt")
    assert inputs["pixel_values"].shape == (1, 3, 336, 336)
    assert (inputs["input_ids"] == config.image_token_id).sum() == LLAVA_1_5_7B_SPEC.num_image_tokens == 576


def test_bf16_checkpoint_at_the_real_weight_scale(bf16_checkpoint):
    tensors = _tensors(bf16_checkpoint)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16} and checkpoint_dtype(bf16_checkpoint) == torch.bfloat16
    for name in ("language_model.model.layers.0.self_attn.q_proj.weight", "language_model.model.layers.1.mlp.down_proj.weight",
                 "language_model.lm_head.weight", "multi_modal_projector.linear_2.weight"):
        assert tensors[name].float().std().item() == pytest.approx(0.02, rel=0.1), name
    assert tensors["language_model.model.embed_tokens.weight"].shape == (600, 128)  # padded past the tokenizer
    config = json.loads((bf16_checkpoint / "config.json").read_text())
    assert config["text_config"]["initializer_range"] == 0.02 and config["text_config"]["vocab_size"] == 600
    assert {"tokenizer.json", "processor_config.json", "chat_template.jinja", "generation_config.json"} <= {
        p.name for p in bf16_checkpoint.iterdir()
    }


def test_bf16_checkpoint_loads_and_runs_in_both_engines(bf16_checkpoint):
    processor = AutoProcessor.from_pretrained(bf16_checkpoint)
    assert len(processor.tokenizer) < 600  # the padded rows have no token, as in llava-hf checkpoints
    hf = LlavaForConditionalGeneration.from_pretrained(bf16_checkpoint, dtype=torch.float32)
    inputs = processor(text="USER: <image>\nhi ASSISTANT:", images=[make_test_image(1)], return_tensors="pt")
    assert (inputs["input_ids"] == hf.config.image_token_id).sum() == SMALL.num_image_tokens == 4
    with torch.inference_mode():
        assert torch.isfinite(hf(**inputs).logits).all()
    engine = MMEngine(str(bf16_checkpoint), max_model_len=256, device="cpu")
    (out,) = engine.generate("USER: <image>\nhi ASSISTANT:", images=[make_test_image(1)],
                             sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 4 and all(0 <= t < 600 for t in out.token_ids)


def test_builds_are_deterministic_and_leave_global_state_alone(tmp_path):
    rng = torch.get_rng_state()
    a = build_llava_checkpoint(tmp_path / "a", SMALL, dtype=torch.float16, initializer_range=0.05)
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_default_dtype() == torch.float32
    b = build_llava_checkpoint(tmp_path / "b", SMALL, dtype=torch.float16, initializer_range=0.05)
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert ta["language_model.model.layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(0.05, rel=0.1)


def test_bad_builder_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        build_llava_checkpoint(tmp_path / "x", SMALL, dtype="int8")
    with pytest.raises(ValueError, match="dtype"):
        build_llava_checkpoint(tmp_path / "x", SMALL, dtype=torch.int8)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_llava_checkpoint(tmp_path / "x", TinyLlavaSpec(vocab_size=100))
    with pytest.raises(ValueError, match="vocab_size"):
        TinyLlavaSpec(vocab_size=0)
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU builds above use the same code path")
def test_builds_directly_on_a_gpu(tmp_path):
    cuda_rng = torch.cuda.get_rng_state()
    path = build_llava_checkpoint(tmp_path / "m", SMALL, device="cuda", dtype="bfloat16")
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    tensors = _tensors(path)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert tensors["language_model.model.layers.0.self_attn.q_proj.weight"].float().std().item() == pytest.approx(0.02, rel=0.1)
    engine = MMEngine(str(path), max_model_len=256)
    (out,) = engine.generate("USER: hi ASSISTANT:", sampling_params=SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 2
