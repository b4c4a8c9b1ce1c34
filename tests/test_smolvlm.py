"""Idefics3 and SmolVLM2 end to end against transformers (fp32, CPU). The tiny idefics3 checkpoint resizes
pictures to a longest edge of 96 px and cuts them into 32 px tiles (grids up to 3x3) plus the global image,
each 8x8 patches pixel-shuffled by 2 into 16 tokens; the smolvlm one 64 px tiles (up to 2x2) of 16x16
patches shuffled by 4, with tied embeddings. Both over a Llama decoder. Greedy tokens equal transformers'
generate for text, one picture and two pictures of different grids; pictures that are not split (no
splitting); tiles across prefill-chunk boundaries, a mixed batch, prefix hits with one encoder run per
tile, preemption; the prompt and pixels are transformers' processor's; items are hashed on the picture and
the splitting settings; the key layout loads strictly; SmolVLM2's videos are refused by name."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy
from family_checks import (GREEDY, against_the_processor, check_bad_inputs, check_demo_and_budget, check_every_block_offset,
                           check_mixed_batch, check_pictures_across_chunks, check_preemption, check_repeated_prompt,
                           check_top_logprobs, greedy, save_variant, tiny_engine)
from safetensors.torch import load_file

from mmengine import MMEngine
from mmengine.encoder_cache.hashing import hash_image, hash_image_part, model_fingerprint, processor_settings_key
from mmengine.errors import InvalidInputError, UnsupportedModelError, WeightsMismatchError
from mmengine.testing.images import make_test_image
from mmengine.testing.smolvlm import IDEFICS3_SPEC, SMOLVLM_SPEC, smolvlm_prompt, tiny_smolvlm_path

WIDE, TALL, SQUARE = make_test_image(3, (64, 40)), make_test_image(4, (30, 90)), make_test_image(7, (50, 50))
QUESTION = "Describe the picture in detail."
SPECS = {"idefics3": IDEFICS3_SPEC, "smolvlm": SMOLVLM_SPEC}
# Each family's grids (rows, cols) for WIDE and TALL: different grids within one prompt
GRIDS = {"idefics3": [(2, 3), (3, 1)], "smolvlm": [(2, 2), (2, 1)]}


MAX_MODEL_LEN = 1024


def _engine(path: Path, **kwargs) -> MMEngine:
    return tiny_engine(path, max_model_len=MAX_MODEL_LEN, **kwargs)


@dataclass
class Case:
    family: str
    path: Path
    engine: MMEngine

    def prompt(self, text: str, num_images: int = 0) -> str:
        return smolvlm_prompt(text, num_images, self.family)


@pytest.fixture(scope="module", params=list(SPECS))
def case(request) -> Case:
    path = tiny_smolvlm_path(SPECS[request.param])
    return Case(request.param, path, _engine(path))


@pytest.fixture(scope="module")
def idefics3() -> Case:
    path = tiny_smolvlm_path(IDEFICS3_SPEC)
    return Case("idefics3", path, _engine(path, enable_prefix_caching=False))


@pytest.mark.parametrize("pictures", [[], [WIDE], [WIDE, TALL]], ids=["text", "one", "two-grids"])
def test_greedy_tokens_equal_transformers(case, pictures):
    grids = [case.engine.family.tiles.grid(picture.height, picture.width) for picture in pictures]
    assert grids == GRIDS[case.family][:len(pictures)]
    prompt = case.prompt(QUESTION, len(pictures))
    assert greedy(case.engine, prompt, pictures or None) == [hf_greedy(case.path, prompt, pictures, 12, ignore_eos=True)]


def test_the_prompt_and_pixels_are_transformers(case):
    """For sizes around the tile and odd aspect ratios: the prompt's ids equal transformers' processor's (the
    row/column markers, the global image, each run), each item is a tile (then the global image) of its
    pixels, and the grid agrees with the family's own rule (the resize guard's)."""
    sizes = [(5, 90), (31, 33), (32, 32), (64, 65), (200, 30), (120, 250)]
    for width, height, processed, reference in against_the_processor(case.engine, case.prompt("What?", 1), sizes):
        pixels = torch.stack([item.encoder_inputs["pixel_values"] for item in processed.mm_items])
        assert torch.equal(pixels, reference["pixel_values"][0])
        rows, cols = case.engine.family.tiles.grid(height, width)
        assert len(processed.mm_items) == rows * cols + 1
        assert all(item.length == 16 for item in processed.mm_items)


def test_top_logprobs_are_close(case):
    check_top_logprobs(case.engine, case.path, case.prompt(QUESTION, 2), [TALL, WIDE])


def test_tiles_across_chunk_boundaries(case):
    """Chunks of 24 tokens end inside tiles' runs (causal attention: a chunk may split a tile, whose encoder
    output is computed once and read by each chunk); one encoder run per tile."""
    check_pictures_across_chunks(case.path, case.prompt(QUESTION, 2), [WIDE, TALL], 24, min_split=2, max_model_len=MAX_MODEL_LEN)


def test_a_mixed_batch_equals_each_prompt_alone(idefics3):
    prompts = [idefics3.prompt(QUESTION, 0), idefics3.prompt("What is it?", 1), idefics3.prompt("Compare them.", 2),
               idefics3.prompt("And this one?", 1)]
    check_mixed_batch(idefics3.engine, prompts, [None, [SQUARE], [TALL, WIDE], [TALL]])


def test_a_picture_at_every_offset_from_a_block_boundary(idefics3):
    """The divisible-block matrix at the smallest encoder budget (one tile): one encoder run per tile."""
    cached = _engine(idefics3.path, encoder_cache_size=1)
    assert cached.family.max_tokens_per_item() == 16
    prompts = ["a " * pad + idefics3.prompt("What is it?", 1) for pad in range(5)]
    assert check_every_block_offset(cached, idefics3.engine, prompts, [TALL]) == 4


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(case):
    """One encoder run per tile and one for the global image (each its own encoder-cache entry), none for the
    repeat, whose prompt is a prefix hit but for its last block."""
    prompt, picture = case.prompt(QUESTION, 1), [make_test_image(11, (70, 40))]
    num_items = len(case.engine.input_processor.process(prompt, picture, GREEDY).mm_items)
    assert num_items > 1
    check_repeated_prompt(case.path, case.engine, prompt, picture, items=num_items)


def test_preemption_keeps_the_tokens(idefics3):
    """Two prompts that share no block, each 43 blocks of 4 and 46 once generated, in 88 blocks: both are
    admitted and one is preempted as they grow."""
    prompts = [text + idefics3.prompt(QUESTION, 1) for text in ("One.", "Two!")]
    check_preemption(idefics3.path, prompts, [WIDE], 88, max_model_len=MAX_MODEL_LEN)


def test_pictures_not_split_and_hashed_on_the_splitting_settings(idefics3, tmp_path):
    """A checkpoint whose processor settings turn splitting off makes each picture the global image alone, one
    item, and the tokens are transformers'; the items are hashed on the picture and the processor's settings
    (splitting among them), a split picture's tiles each from the picture's hash and the tile's index."""
    unsplit_path = shutil.copytree(idefics3.path, tmp_path / "unsplit")
    settings_file = unsplit_path / "preprocessor_config.json"
    settings_file.write_text(json.dumps({**json.loads(settings_file.read_text()), "do_image_splitting": False}))
    unsplit = _engine(unsplit_path)
    prompt = idefics3.prompt("Compare them.", 2)
    processed = unsplit.input_processor.process(prompt, [WIDE, TALL], GREEDY)
    assert [item.length for item in processed.mm_items] == [16, 16]
    expected = hf_greedy(unsplit_path, prompt, [WIDE, TALL], 12, ignore_eos=True)
    assert greedy(unsplit, prompt, [WIDE, TALL]) == [expected]
    # a token prompt holding the processor's expanded ids (one run a picture when not split)
    ids = unsplit.input_processor.hf_processor(text=prompt, images=[WIDE, TALL])["input_ids"][0]
    tokens = unsplit.generate({"prompt_token_ids": list(ids), "multi_modal_data": {"image": [WIDE, TALL]}}, sampling_params=GREEDY,
                              use_tqdm=False)[0]
    assert tokens.prompt_token_ids == processed.prompt_token_ids and tokens.token_ids == expected
    # precomputed embeddings stand for a picture that is not split (the tower's output for WIDE here)
    embeds = unsplit.runner.model.encode_items([processed.mm_items[0].encoder_inputs])[0]
    assert greedy(unsplit, prompt, [{"image_embeds": embeds}, TALL]) == [expected]
    with pytest.raises(InvalidInputError, match="image_embeds has 32 rows"):
        greedy(unsplit, prompt, [{"image_embeds": torch.cat([embeds, embeds])}, TALL])
    settings = processor_settings_key(unsplit.input_processor.hf_processor.image_processor)
    split = idefics3.engine.input_processor
    split_settings = processor_settings_key(split.hf_processor.image_processor)
    assert '"do_image_splitting": false' in settings and '"do_image_splitting": true' in split_settings
    assert processed.mm_items[0].mm_hash == hash_image(WIDE, model_fingerprint(unsplit_path), settings)
    tiles = split.process(idefics3.prompt("What?", 1), [WIDE], GREEDY).mm_items
    picture_hash = hash_image(WIDE, model_fingerprint(idefics3.path), split_settings)
    assert picture_hash != hash_image(WIDE, model_fingerprint(idefics3.path), settings)
    assert [item.mm_hash for item in tiles] == [hash_image_part(picture_hash, k) for k in range(7)]


def test_the_chat_template_gives_the_text_prompt(case):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = case.engine.input_processor.apply_chat_template(messages)
    assert prompt == case.prompt("What is it?", 1)
    chat = case.engine.chat(messages, images=[SQUARE], sampling_params=GREEDY, use_tqdm=False)[0]
    assert chat.token_ids == greedy(case.engine, prompt, [SQUARE])[0]


def test_bad_inputs_are_typed_errors(case):
    engine = case.engine
    check_bad_inputs(engine, case.prompt("What?", 1), [WIDE, TALL], count_match="1 <image> marker",
                     video_prompt=case.prompt("What happens?") + "<video>")
    with pytest.raises(InvalidInputError, match="image tiles"):  # a split picture's runs sit between text tokens
        engine.generate({"prompt_token_ids": [5, engine.family.image_token_id, 6], "multi_modal_data": {"image": WIDE}},
                        sampling_params=GREEDY, use_tqdm=False)


def test_a_lora_adapter_matches_transformers_and_peft(idefics3, tmp_path):
    """A PEFT adapter on the decoder's projections, the tower's and the connector's projection: the tokens are
    transformers' + PEFT's, and the base model's beside them in the same batch transformers' alone."""
    from conftest import CPU_FP32, _hf_inputs, _hf_model, save_peft_adapter
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mmengine.lora.request import LoRARequest

    targets = r".*(text_model.*\.(q_proj|v_proj|down_proj)|vision_model.*\.(q_proj|fc1)|connector.*\.proj)"
    adapter = save_peft_adapter(idefics3.path, tmp_path / "adapter", 4, 8, False, targets, seed=3)
    prompt = idefics3.prompt(QUESTION, 1)
    base = AutoModelForImageTextToText.from_pretrained(str(idefics3.path), dtype=torch.float32).eval()
    inputs = _hf_inputs(_hf_model(idefics3.path, CPU_FP32)[1], prompt, [WIDE], CPU_FP32)
    with torch.inference_mode():
        out = PeftModel.from_pretrained(base, str(adapter)).eval().generate(**inputs, do_sample=False, max_new_tokens=12,
                                                                             eos_token_id=None)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    engine = _engine(idefics3.path, enable_lora=True, max_loras=1, max_lora_rank=8)
    outputs = engine.generate([prompt] * 2, images=[[WIDE]] * 2, sampling_params=GREEDY, use_tqdm=False,
                              lora=[LoRARequest("a", str(adapter)), None])
    assert [o.token_ids for o in outputs] == [expected, hf_greedy(idefics3.path, prompt, [WIDE], 12, ignore_eos=True)]
    assert expected != outputs[1].token_ids and engine.stats()["lora_adapters_on_vision"] == 1


def test_the_key_layout_loads_strictly(idefics3, tmp_path):
    """transformers 5 and the published checkpoints name tensors `model.text_model.*`, `model.vision_model.*`,
    `model.connector.*` and `lm_head.weight`: a missing tensor, and one the model has no place for, are named."""
    tensors = load_file(str(idefics3.path / "model.safetensors"))
    assert {name.split(".")[1] for name in tensors if name.startswith("model.")} == {"text_model", "vision_model", "connector"}
    missing = save_variant(idefics3.path, tmp_path / "missing", {n: t for n, t in tensors.items() if "modality_projection" not in n})
    with pytest.raises(WeightsMismatchError, match="modality_projection"):
        _engine(missing)
    extra = save_variant(idefics3.path, tmp_path / "extra", {**tensors, "model.connector.extra.weight": torch.zeros(2)})
    with pytest.raises(WeightsMismatchError, match="connector.extra"):
        _engine(extra)


def test_tiles_the_connector_cannot_shuffle_are_refused(idefics3, tmp_path):
    """36 px tiles are 9x9 patches of 4 px, which a pixel shuffle by 2 cannot fold: refused by name at start-up."""
    changed = shutil.copytree(idefics3.path, tmp_path / "odd-tiles")
    settings_file = changed / "preprocessor_config.json"
    settings_file.write_text(json.dumps({**json.loads(settings_file.read_text()), "max_image_size": {"longest_edge": 36}}))
    with pytest.raises(UnsupportedModelError, match="tiles of 36 px"):
        _engine(changed)


@pytest.mark.parametrize("family", list(SPECS))
def test_demo_and_budget(family, tmp_path, capsys):
    shown = check_demo_and_budget(family, tiny_smolvlm_path(SPECS[family]), tmp_path, capsys, max_model_len=MAX_MODEL_LEN)
    grid, items = {"idefics3": ("3x3", 10), "smolvlm": ("2x2", 5)}[family]
    assert "one item per tile" in shown and f"up to {grid} tiles plus the global image" in shown
    assert f"(a picture is up to {items} items)" in shown


def test_the_encoder_budget_counts_a_pictures_tiles(idefics3):
    """One sequence of one picture may need ten tiles encoded in a step: the budget's cap counts them."""
    engine = _engine(idefics3.path, max_num_seqs=1, limit_mm_per_prompt={"image": 1})
    assert engine.family.max_items_per_image == 10
    assert engine.encoder_budget.items_cap == 10 and engine.encoder_budget.compute_budget_tokens == 10 * 16
    prompt = idefics3.prompt("What is it?", 1)
    assert greedy(engine, prompt, [SQUARE]) == greedy(idefics3.engine, prompt, [SQUARE])
