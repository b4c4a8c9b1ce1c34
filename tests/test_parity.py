"""Greedy tokens from MMEngine equal transformers' LlavaForConditionalGeneration.generate, token for token.

Both run on the same device in fp32 (`exact_precision`: CPU, and CUDA when a GPU is present); bf16
is checked by logits within a tolerance in test_logits.py."""

from __future__ import annotations

import pytest

from conftest import hf_greedy
from mmengine import MMEngine, SamplingParams
from mmengine.testing import TinyLlavaSpec, make_test_image

SPECS = {
    "llama-clip": TinyLlavaSpec(text_model="llama", vision_model="clip"),
    "qwen2-siglip": TinyLlavaSpec(text_model="qwen2", vision_model="siglip", tie_word_embeddings=True, seed=1),
    "mistral-clip-multilayer": TinyLlavaSpec(text_model="mistral", vision_model="clip", vision_feature_layer=(-3, -1), seed=2),
    "llama-siglip": TinyLlavaSpec(text_model="llama", vision_model="siglip", seed=3),
}

MAX_TOKENS = 12
IMG_A, IMG_B, IMG_C = make_test_image(11), make_test_image(12, size=(64, 30)), make_test_image(13, mode="RGBA")

CASES = [
    ("USER: Tell me a story about a boat. ASSISTANT:", []),
    ("USER: <image>\nWhat is shown here? ASSISTANT:", [IMG_A]),
    ("USER: <image>\nand <image>\nCompare the two pictures in detail please. ASSISTANT:", [IMG_B, IMG_A]),
    ("<image>", [IMG_C]),
    ("USER: hi ASSISTANT:", []),
]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _expected(path, cases, precision):
    return [hf_greedy(path, prompt, images, MAX_TOKENS, precision) for prompt, images in cases]


@pytest.mark.parametrize("name", list(SPECS))
def test_batch_matches_transformers(checkpoint_dir, exact_precision, name):
    """No image, one image, two images and different lengths in one continuously batched run."""
    path = checkpoint_dir(SPECS[name])
    engine = MMEngine(str(path), max_model_len=512, **exact_precision.engine_kwargs)
    outputs = engine.generate([c[0] for c in CASES], images=[c[1] for c in CASES], sampling_params=_params(), use_tqdm=False)
    assert [o.token_ids for o in outputs] == _expected(path, CASES, exact_precision)
    assert [o.prompt for o in outputs] == [c[0] for c in CASES]


@pytest.mark.parametrize("name", ["llama-clip", "qwen2-siglip"])
def test_single_requests_match_transformers(checkpoint_dir, exact_precision, name):
    path = checkpoint_dir(SPECS[name])
    engine = MMEngine(str(path), max_model_len=512, **exact_precision.engine_kwargs)
    for (prompt, images), expected in zip(CASES[:3], _expected(path, CASES[:3], exact_precision)):
        (out,) = engine.generate(prompt, images=images, sampling_params=_params(), use_tqdm=False)
        assert out.token_ids == expected


@pytest.mark.parametrize("name", ["llama-clip", "qwen2-siglip"])
def test_chunked_prefill_matches_transformers(checkpoint_dir, exact_precision, name):
    """max_num_batched_tokens smaller than the prompts: images are split across prefill chunks."""
    path = checkpoint_dir(SPECS[name])
    engine = MMEngine(str(path), max_model_len=512, max_num_batched_tokens=7, block_size=8, **exact_precision.engine_kwargs)
    outputs = engine.generate([c[0] for c in CASES], images=[c[1] for c in CASES], sampling_params=_params(), use_tqdm=False)
    assert [o.token_ids for o in outputs] == _expected(path, CASES, exact_precision)
    assert engine.stats()["steps"] > sum(len(o.prompt_token_ids) for o in outputs) // 7


@pytest.mark.parametrize("name", ["llama-clip", "qwen2-siglip"])
def test_preemption_matches_transformers(checkpoint_dir, exact_precision, name):
    """So few KV blocks that running requests are preempted and recomputed; outputs are unchanged."""
    path = checkpoint_dir(SPECS[name])
    cases = CASES * 2
    # Without prefix grouping: its KV gate admits a group's members only when they fit, so the
    # duplicated prompts would never be preempted.
    engine = MMEngine(str(path), max_model_len=512, block_size=8, num_kv_blocks=16, enable_prefix_grouping=False,
                      **exact_precision.engine_kwargs)
    outputs = engine.generate([c[0] for c in cases], images=[c[1] for c in cases], sampling_params=_params(), use_tqdm=False)
    assert engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outputs] == _expected(path, cases, exact_precision)
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_sharded_checkpoint_loads_identically(tmp_path, checkpoint_dir, exact_precision):
    from mmengine.testing import build_tiny_llava

    spec = SPECS["llama-clip"]
    sharded = build_tiny_llava(tmp_path / "sharded", spec, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    prompt, images = CASES[1]
    engine = MMEngine(str(sharded), max_model_len=256, **exact_precision.engine_kwargs)
    (out,) = engine.generate(prompt, images=images, sampling_params=_params(), use_tqdm=False)
    assert out.token_ids == hf_greedy(checkpoint_dir(spec), prompt, images, MAX_TOKENS, exact_precision)
