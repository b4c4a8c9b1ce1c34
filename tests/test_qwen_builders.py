"""mmengine.testing's Qwen2-VL / Qwen2.5-VL builders: checkpoints that transformers' own classes load and
run, with variable-size images, M-RoPE, and (2.5) window attention over several windows."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
)
from transformers.utils import is_torchvision_available
from transformers.utils import logging as hf_logging

import mmengine.testing.qwen_vl as mq
from mmengine.testing import (
    QWEN2_5_VL_7B_SPEC,
    QWEN_CHAT_TEMPLATE,
    TinyQwenVLSpec,
    build_qwen_vl_checkpoint,
    build_tiny_qwen_vl,
    load_qwen_vl_processor,
    make_test_image,
    qwen_vl_prompt,
    tiny_qwen_vl_path,
)
from mmengine.testing.weights import TINY_INITIALIZER_RANGE
from conftest import hf_greedy
from helpers import checkpoint_tensors

hf_logging.disable_progress_bar()

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
MODEL_CLASS = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}
PROCESSOR_CLASS = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# (width, height) -> merged tokens: each side rounded to a multiple of 28 (scaled up to min_pixels = 4 * 28^2
# or down to max_pixels = 64 * 28^2, keeping the aspect ratio), then (h / 28) * (w / 28) tokens.
IMAGE_TOKENS = {(40, 40): 4, (48, 40): 6, (64, 100): 8, (120, 60): 8, (90, 120): 12, (120, 120): 16, (1000, 1000): 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("qwen")
    return {family: tiny_qwen_vl_path(TinyQwenVLSpec(family=family), cache_dir=root) for family in FAMILIES}


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """family -> (processor, model), as transformers loads them."""
    return {
        family: (load_qwen_vl_processor(path), AutoModelForImageTextToText.from_pretrained(path).eval())
        for family, path in checkpoints.items()
    }


# --- checkpoint contents -------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_files_and_config(checkpoints, family):
    path = checkpoints[family]
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "chat_template.jinja",
    } <= {p.name for p in path.iterdir()}
    config = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    assert config.model_type == family and config.architectures == [MODEL_CLASS[family].__name__]
    # The special tokens follow the learned vocabulary, in the published order, and are the config's ids.
    assert list(ids.values()) == list(range(len(tok) - 7, len(tok)))
    assert config.image_token_id == ids["<|image_pad|>"] and config.video_token_id == ids["<|video_pad|>"]
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.vision_end_token_id == ids["<|vision_end|>"]
    text, vision = config.text_config, config.vision_config
    assert text.vocab_size == len(tok)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert (text.eos_token_id, text.pad_token_id) == (ids["<|im_end|>"], ids["<|endoftext|>"])
    gen = GenerationConfig.from_pretrained(path)
    assert gen.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]] and gen.pad_token_id == ids["<|endoftext|>"]
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (64, 2, 4, 2)
    assert text.rope_parameters["mrope_section"] == [2, 3, 3]  # sums to head_dim / 2 = 8
    assert text.initializer_range == vision.initializer_range == TINY_INITIALIZER_RANGE
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (14, 2, 2)
    if family == "qwen2_vl":
        assert (vision.depth, vision.embed_dim, vision.hidden_size, vision.mlp_ratio) == (2, 32, 64, 2)
    else:
        assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (4, 32, 64)
        assert (list(vision.fullatt_block_indexes), vision.window_size) == ([1, 3], 56)
    pre = json.loads((path / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor"  # the PIL class saves under the base name
    assert pre["size"] == {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_layout_and_scale(checkpoints, loaded, family):
    tensors = checkpoint_tensors(checkpoints[family])
    # The published checkpoints' key layout, which transformers converts on load.
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "visual.patch_embed.proj.weight"} <= set(tensors)
    assert "model.layers.1.self_attn.q_proj.bias" in tensors and "visual.blocks.1.attn.qkv.bias" in tensors
    assert "visual.merger.mlp.2.weight" in tensors
    assert tensors["visual.patch_embed.proj.weight"].shape == (32, 3, 2, 14, 14)
    for name in ("model.layers.0.self_attn.q_proj.weight", "visual.blocks.0.attn.qkv.weight", "lm_head.weight"):
        assert tensors[name].std().item() == pytest.approx(0.2, rel=0.1), name
    # Biases and norm weights are perturbed away from transformers' constants (0 and 1), so a parity test
    # notices one that is dropped or swapped.
    for name in ("model.layers.0.self_attn.k_proj.bias", "model.layers.1.input_layernorm.weight", "model.norm.weight",
                 "visual.blocks.0.attn.qkv.bias", "visual.merger.mlp.0.bias"):
        assert tensors[name].std().item() > 0.1, name
    assert not torch.equal(tensors["model.layers.0.input_layernorm.weight"], tensors["model.layers.0.post_attention_layernorm.weight"])
    _, model = loaded[family]
    assert type(model) is MODEL_CLASS[family]
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in tensors.values())
    torch.testing.assert_close(model.lm_head.weight, tensors["lm_head.weight"], rtol=0, atol=0)


def test_tied_embeddings_and_dtype(tmp_path):
    path = build_tiny_qwen_vl(tmp_path / "m", TinyQwenVLSpec(family="qwen2_vl", tie_word_embeddings=True, dtype="float16"))
    tensors = checkpoint_tensors(path)
    assert "lm_head.weight" not in tensors and {t.dtype for t in tensors.values()} == {torch.float16}
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert model.config.tie_word_embeddings and model.dtype == torch.float16
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()


def test_build_is_deterministic_seeded_and_leaves_rng_alone(tmp_path, checkpoints):
    rng = torch.get_rng_state()
    again = build_tiny_qwen_vl(tmp_path / "again")
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_default_dtype() == torch.float32
    for f in checkpoints["qwen2_5_vl"].iterdir():
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    other = build_tiny_qwen_vl(tmp_path / "other", TinyQwenVLSpec(seed=1))
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


# --- tokenizer, processor, chat template ---------------------------------------------------------


def test_tokenizer(checkpoints):
    tok = AutoTokenizer.from_pretrained(checkpoints["qwen2_vl"])
    assert tok.padding_side == "left"
    prompt = qwen_vl_prompt("What is this?", num_images=2)
    ids = tok(prompt).input_ids
    assert ids == tok(prompt, add_special_tokens=False).input_ids  # no BOS, nothing added
    counts = {token: ids.count(tok.convert_tokens_to_ids(token)) for token in SPECIAL}  # never split
    assert counts == {"<|endoftext|>": 0, "<|im_start|>": 2, "<|im_end|>": 1, "<|vision_start|>": 2,
                      "<|vision_end|>": 2, "<|image_pad|>": 2, "<|video_pad|>": 0}
    assert tok.decode(ids) == prompt
    assert tok.decode(ids, skip_special_tokens=True) == "user\nWhat is this?\nassistant\n"
    text = "The quick brown fox, 42 apples & émigré café!"
    assert tok.decode(tok(text).input_ids) == text


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_expands_image_pad_per_image_size(loaded, family):
    processor, model = loaded[family]
    assert isinstance(processor, PROCESSOR_CLASS[family])
    image_id = model.config.image_token_id
    for (width, height), expected in IMAGE_TOKENS.items():
        inputs = processor(text=qwen_vl_prompt("What is this?", 1), images=[make_test_image(0, (width, height))], return_tensors="pt")
        (t, h, w), = inputs["image_grid_thw"].tolist()
        ids = inputs["input_ids"][0]
        assert (ids == image_id).sum().item() == t * h * w // 4 == expected, (width, height)
        assert inputs["pixel_values"].shape == (t * h * w, 3 * 2 * 14 * 14)
        # One contiguous run, between <|vision_start|> and <|vision_end|>.
        positions = (ids == image_id).nonzero().flatten().tolist()
        assert positions == list(range(positions[0], positions[0] + expected))
        assert ids[positions[0] - 1] == model.config.vision_start_token_id
        assert ids[positions[-1] + 1] == model.config.vision_end_token_id

    # Two images of different sizes in one prompt, and a batch of prompts with left padding.
    images = [make_test_image(1, (48, 40)), make_test_image(2, (120, 120))]
    inputs = processor(text=qwen_vl_prompt("Compare", 2), images=images, return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 8]]
    assert (inputs["input_ids"] == image_id).sum() == 6 + 16
    batch = processor(
        text=[qwen_vl_prompt("Compare these two pictures", 2), qwen_vl_prompt("hi", 1)],
        images=images + [make_test_image(3, (90, 120), "RGBA")],
        return_tensors="pt",
        padding=True,
    )
    assert (batch["input_ids"] == image_id).sum(1).tolist() == [22, 12]
    assert batch["attention_mask"][1, 0] == 0 and batch["input_ids"][1, 0] == processor.tokenizer.pad_token_id


def test_chat_template(loaded):
    processor, model = loaded["qwen2_5_vl"]
    render = processor.apply_chat_template
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    expected = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n"
    assert render([user], add_generation_prompt=True) == expected == qwen_vl_prompt("What is this?", 1)
    assert render([{"role": "user", "content": "Hi"}], add_generation_prompt=True) == qwen_vl_prompt("Hi")
    conversation = [
        {"role": "system", "content": "You are helpful."},
        user,
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "image"}]},
    ]
    assert render(conversation) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nCompare <|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
    )
    assert processor.chat_template == QWEN_CHAT_TEMPLATE
    with pytest.raises(Exception, match="unsupported content part type"):
        render([{"role": "user", "content": [{"type": "audio"}]}])
    # Tokenized, with the image inline: the processor expands the marker for that image's size.
    messages = [{"role": "user", "content": [{"type": "image", "image": make_test_image(5, (120, 60))}, {"type": "text", "text": "Hi"}]}]
    out = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    assert (out["input_ids"][0] == model.config.image_token_id).sum() == IMAGE_TOKENS[(120, 60)]
    assert out["image_grid_thw"].tolist() == [[1, 4, 8]]


@pytest.mark.skipif(not is_torchvision_available(), reason="needs torchvision: without it transformers' AutoProcessor "
                    "cannot build any Qwen-VL processor (it always loads the torchvision-only video processor); "
                    "test_processor_expands_image_pad_per_image_size covers the PIL path")
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_processor_with_torchvision(checkpoints, family):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoints[family])
    assert type(processor) is PROCESSOR_CLASS[family]
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"  # the torchvision backend
    inputs = processor(text=qwen_vl_prompt("hi", 1), images=[make_test_image(0, (90, 120))], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 6]]


def test_load_qwen_vl_processor(checkpoints, tmp_path):
    """Without torchvision: the family's own processor class (its image and text code), minus the video part."""
    for family, path in checkpoints.items():
        processor = load_qwen_vl_processor(path)
        assert isinstance(processor, PROCESSOR_CLASS[family])
        if not is_torchvision_available():
            assert type(processor).get_attributes() == ["image_processor", "tokenizer"]
            assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError, match="not a Qwen2-VL"):  # (a LLaVA config)
        load_qwen_vl_processor(tmp_path)


# --- generation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_two_images_of_different_sizes_and_text_only(checkpoints, family):
    path = checkpoints[family]
    images = [make_test_image(1, (48, 40)), make_test_image(2, (120, 90))]
    prompts = [qwen_vl_prompt("Compare the two pictures.", 2), qwen_vl_prompt("Tell me a story about a boat.")]
    two, text_only = (hf_greedy(path, prompt, imgs, 8, ignore_eos=True) for prompt, imgs in zip(prompts, [images, []]))
    assert len(two) == len(text_only) == 8
    vocab = AutoConfig.from_pretrained(path).text_config.vocab_size
    assert all(0 <= t < vocab for t in two + text_only)
    # Deterministic, and the images matter: swapping them changes the continuation.
    assert hf_greedy(path, prompts[0], images, 8, ignore_eos=True) == two
    assert hf_greedy(path, prompts[0], images[::-1], 8, ignore_eos=True) != two
    # Stopping at eos: the same tokens up to and including the first <|im_end|> / <|endoftext|>.
    stopped = hf_greedy(path, prompts[0], images, 8)
    eos = set(GenerationConfig.from_pretrained(path).eos_token_id)
    cut = next((i + 1 for i, t in enumerate(two) if t in eos), 8)
    assert stopped == two[:cut]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_well_defined_and_input_dependent(loaded, family):
    """Greedy decoding must not hinge on near-ties and must depend on the image and the prompt."""
    processor, model = loaded[family]
    images = [make_test_image(s, size) for s, size in [(0, (48, 40)), (1, (120, 120)), (2, (64, 100))]]
    texts = ["What is this?", "Describe the image in detail."]
    gaps, outputs = [], set()
    for text in texts:
        for image in images:
            inputs = processor(text=qwen_vl_prompt(text, 1), images=[image], return_tensors="pt")
            out = model.generate(**inputs, do_sample=False, max_new_tokens=8, eos_token_id=None,
                                 output_scores=True, return_dict_in_generate=True)
            gaps += [(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores]
            new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
            assert len(set(new)) > 1
            outputs.add(tuple(new))
    assert len(outputs) == len(texts) * len(images)
    assert min(gaps) > 1e-4
    assert float(np.median(gaps)) > 0.1


# --- Qwen2.5-VL window attention -----------------------------------------------------------------


def _vision_cu_seqlens(model, inputs) -> list[list[int]]:
    """The cu_seqlens each vision block attends within, recorded while the tower runs."""
    seen = []
    hooks = [
        block.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs["cu_seqlens"].tolist()), with_kwargs=True)
        for block in model.model.visual.blocks
    ]
    try:
        with torch.inference_mode():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_qwen2_5_vision_tower_uses_several_windows(loaded):
    processor, model = loaded["qwen2_5_vl"]
    images = [make_test_image(1, (120, 120)), make_test_image(2, (48, 40))]  # 8x8 and 4x6 patches
    inputs = processor(text=qwen_vl_prompt("hi", 2), images=images, return_tensors="pt")
    windowed, full, windowed2, full2 = _vision_cu_seqlens(model, inputs)  # fullatt_block_indexes = [1, 3]
    assert full == full2 == [0, 64, 88]  # one sequence per image
    # 56-pixel windows = 2x2 merged tokens = 16 patches: 2x2 windows on the 8x8-patch image, and on the 4x6
    # one (2x3 merged) a full window and one cut to 2x1 merged tokens.
    assert windowed == windowed2 == [0, 16, 32, 48, 64, 80, 88]
    # And windows change the result: the same tower with one window per image gives other embeddings.
    with torch.inference_mode():
        pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
        windowed_out = model.model.visual(pixels, grid_thw=grid).pooler_output
        model.model.visual.window_size = 10_000
        try:
            whole_out = model.model.visual(pixels, grid_thw=grid).pooler_output
        finally:
            model.model.visual.window_size = 56
    assert windowed_out.shape == whole_out.shape == (16 + 6, 64)
    assert (windowed_out - whole_out).abs().max() > 1e-2


def test_qwen2_vision_tower_attends_per_image(loaded):
    processor, model = loaded["qwen2_vl"]
    images = [make_test_image(1, (120, 120)), make_test_image(2, (48, 40))]
    inputs = processor(text=qwen_vl_prompt("hi", 2), images=images, return_tensors="pt")
    assert _vision_cu_seqlens(model, inputs) == [[0, 64, 88]] * 2


# --- cache, specs, real shapes -------------------------------------------------------------------


def test_tiny_qwen_vl_path_caches(tmp_path, monkeypatch):
    first = tiny_qwen_vl_path(TinyQwenVLSpec(family="qwen2_vl"), cache_dir=tmp_path)
    assert first.parent == tmp_path and first.name.startswith("qwen2_vl-") and (first / "model.safetensors").is_file()

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a cached checkpoint")

    monkeypatch.setattr(mq, "build_tiny_qwen_vl", fail)
    monkeypatch.setenv("MMENGINE_CACHE_DIR", str(tmp_path))
    assert tiny_qwen_vl_path(TinyQwenVLSpec(family="qwen2_vl")) == first
    with pytest.raises(AssertionError, match="rebuilt"):
        tiny_qwen_vl_path(TinyQwenVLSpec(family="qwen2_vl", seed=1))
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # the failed build left nothing behind


def test_spec_validation(tmp_path):
    with pytest.raises(ValueError, match="family"):
        TinyQwenVLSpec(family="qwen4_vl")
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        TinyQwenVLSpec(family="qwen3_vl", deepstack_visual_indexes=(0, 3))
    with pytest.raises(ValueError, match="mrope_section"):
        TinyQwenVLSpec(mrope_section=(4, 4, 4))
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        TinyQwenVLSpec(family="qwen2_vl", fullatt_block_indexes=(1,))
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        TinyQwenVLSpec(fullatt_block_indexes=(4,))
    with pytest.raises(ValueError, match="window_size"):
        TinyQwenVLSpec(window_size=50)
    with pytest.raises(ValueError, match="mlp_ratio"):
        TinyQwenVLSpec(family="qwen2_vl", vision_intermediate_size=48)
    with pytest.raises(ValueError, match="min_pixels"):
        TinyQwenVLSpec(min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 4)
    with pytest.raises(ValueError, match="dtype"):
        TinyQwenVLSpec(dtype="int8")
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_tiny_qwen_vl(tmp_path / "x", TinyQwenVLSpec(vocab_size=100))
    assert not (tmp_path / "x").exists()
    assert TinyQwenVLSpec(family="qwen2_vl").vision_layers == 2 and TinyQwenVLSpec().vision_layers == 4
    assert TinyQwenVLSpec().max_image_tokens == 64
    qwen3 = TinyQwenVLSpec(family="qwen3_vl")
    assert qwen3.vision_layers == 3 and qwen3.patch == 16 and qwen3.max_image_tokens == 49


def test_the_7b_spec_has_the_published_shape():
    """8,292,166,656 parameters like Qwen/Qwen2.5-VL-7B-Instruct (counted on the meta device: no memory)."""
    spec = QWEN2_5_VL_7B_SPEC
    tokenizer = mq._build_tokenizer(spec.tokenizer_vocab_size)
    config = mq._build_config(spec, tokenizer, 0.02)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (3584, 18944, 28)
    assert (text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (28, 4, 152064)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.rope_parameters["rope_theta"] == 1e6
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads) == (32, 1280, 3420, 16)
    assert (vision.out_hidden_size, list(vision.fullatt_block_indexes), vision.window_size) == (3584, [7, 15, 23, 31], 112)
    assert text.initializer_range == vision.initializer_range == 0.02 and spec.dtype == "bfloat16"
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 8_292_166_656
    processor = mq._build_processor(spec, tokenizer)
    inputs = processor(text=qwen_vl_prompt("What is this?", 1), images=[make_test_image(0, (640, 480))], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 34, 46]]  # 476 x 644 pixels
    assert (inputs["input_ids"] == config.image_token_id).sum() == 34 * 46 // 4 == 391


def test_real_scale_builds_in_bf16(tmp_path):
    small = TinyQwenVLSpec(hidden_size=128, intermediate_size=256, vocab_size=600, mrope_section=(4, 6, 6))
    path = build_qwen_vl_checkpoint(tmp_path / "m", small, dtype="bfloat16")
    tensors = checkpoint_tensors(path)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert tensors["model.layers.0.mlp.up_proj.weight"].float().std().item() == pytest.approx(0.02, rel=0.1)
    assert tensors["model.embed_tokens.weight"].shape == (600, 128)  # padded past the tokenizer
    assert torch.all(tensors["model.layers.0.self_attn.q_proj.bias"] == 0)  # transformers' own init, unperturbed
    with pytest.raises(ValueError, match="dtype"):
        build_qwen_vl_checkpoint(tmp_path / "x", small, dtype="int8")
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU builds above use the same code path")
def test_builds_directly_on_a_gpu(tmp_path):
    cuda_rng = torch.cuda.get_rng_state()
    path = build_qwen_vl_checkpoint(tmp_path / "m", TinyQwenVLSpec(), device="cuda", dtype="bfloat16")
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    tensors = checkpoint_tensors(path)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
    processor = load_qwen_vl_processor(path)
    inputs = processor(text=qwen_vl_prompt("hi", 1), images=[make_test_image(0, (90, 120))], return_tensors="pt").to("cuda")
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=3, eos_token_id=None)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


def test_the_qwen3_8b_spec_has_the_published_shape():
    """8,767,123,696 parameters like Qwen/Qwen3-VL-8B-Instruct (counted on the meta device: no memory)."""
    from transformers import Qwen3VLForConditionalGeneration

    from mmengine.testing import QWEN3_VL_8B_SPEC

    spec = QWEN3_VL_8B_SPEC
    config = mq._build_config(spec, mq._build_tokenizer(spec.tokenizer_vocab_size), 0.02)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.head_dim) == (4096, 12288, 36, 128)
    assert (text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (32, 8, 151936)
    assert text.rope_parameters["mrope_section"] == [24, 20, 20] and text.rope_parameters["rope_theta"] == 5e6
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads) == (27, 1152, 4304, 16)
    assert (vision.out_hidden_size, list(vision.deepstack_visual_indexes), vision.patch_size) == (4096, [8, 16, 24], 16)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 8_767_123_696
    settings = mq._video_processor_settings(spec)
    assert settings["size"] == {"shortest_edge": 4096, "longest_edge": 25165824}  # the published video bounds
