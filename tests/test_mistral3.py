"""Mistral 3 end to end against transformers (fp32, CPU): the tiny checkpoint's Pixtral tower takes 4 px patches at
the picture's native resolution (longest edge at most 64 px), merged 2x2 into 8 px tokens, over a Mistral decoder.
Greedy tokens equal transformers' generate for text, one picture and two pictures of different sizes and aspect
ratios, top logprobs are close; the prompt's [IMG] / [IMG_BREAK] / [IMG_END] rows and the pixels equal
transformers' model inputs (its PIL image processor; the rows as PixtralProcessor.replace_image_token writes them,
rebuilt here since PixtralProcessor needs torchvision); a picture across prefill-chunk boundaries, a mixed batch, a
prefix hit with one encoder run, the divisible-block matrix, preemption, both key layouts, typed errors, demo and
budget."""

from __future__ import annotations

import pytest
from conftest import hf_greedy
from family_checks import (GREEDY, check_bad_inputs, check_both_key_layouts, check_demo_and_budget, check_every_block_offset,
                           check_mixed_batch, check_pictures_across_chunks, check_preemption, check_repeated_prompt,
                           check_token_prompts, check_top_logprobs, engine_fixtures, greedy, tiny_engine)

from mmengine.errors import ImageCountMismatchError
from mmengine.testing.images import make_test_image
from mmengine.testing.mistral3 import mistral3_prompt, tiny_mistral3_path

WIDE, TALL, SMALL = make_test_image(3, (90, 30)), make_test_image(4, (50, 70)), make_test_image(5, (20, 20))
QUESTION = "Describe the picture in detail."

path, engine, uncached = engine_fixtures(tiny_mistral3_path)


@pytest.mark.parametrize("pictures", [[], [WIDE], [WIDE, TALL]], ids=["text", "wide", "wide,tall"])
def test_greedy_tokens_equal_transformers(path, engine, pictures):
    prompt = mistral3_prompt(QUESTION, len(pictures))
    assert greedy(engine, prompt, pictures or None) == [hf_greedy(path, prompt, pictures, 12, ignore_eos=True)]


def test_top_logprobs_are_close(path, uncached):
    check_top_logprobs(uncached, path, mistral3_prompt(QUESTION, 2), [TALL, WIDE], pictures_matter=True)


def _reference_rows(tokenizer, height: int, width: int, merged: int) -> list[int]:
    """PixtralProcessor.replace_image_token's rows: [IMG] x cols + [IMG_BREAK] a row, the last [IMG_END]."""
    image, breaks, end = tokenizer.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    rows = ([image] * (width // merged) + [breaks]) * (height // merged)
    rows[-1] = end
    return rows


def test_prompt_and_pixels_are_transformers(path, engine):
    """For sizes around the merged patch, odd ratios and pictures above the longest edge: the pixels are
    transformers' PIL image processor's at PixtralProcessor's merged patch size, the prompt holds its rows."""
    from transformers import AutoTokenizer, PixtralImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    reference = PixtralImageProcessorPil.from_pretrained(str(path))
    processor = engine.input_processor
    for index, (width, height) in enumerate([(5, 90), (7, 7), (8, 8), (31, 33), (64, 64), (65, 17), (200, 30), (120, 250)]):
        picture = make_test_image(index, (width, height))
        want = reference([picture], patch_size={"height": 8, "width": 8}, return_tensors="pt")
        (h, w) = (int(v) for v in want["image_sizes"][0])
        processed = processor.process(mistral3_prompt("What?", 1), [picture], GREEDY)
        (item,) = processed.mm_items
        assert item.encoder_inputs["pixel_values"].equal(want["pixel_values"][0, :, :h, :w])
        prefix, suffix = (tokenizer(text)["input_ids"] for text in mistral3_prompt("What?", 1).split("[IMG]"))
        assert processed.prompt_token_ids == prefix + _reference_rows(tokenizer, h, w, 8) + suffix
        assert (item.offset, item.length) == (len(prefix), (h // 8) * (w // 8 + 1))
        assert engine.family.resized_size(height, width) == (h, w)


def test_a_token_prompt_with_one_placeholder_per_picture(engine):
    prompt = mistral3_prompt("Compare them.", 2)
    text = check_token_prompts(engine, prompt, [WIDE, TALL], [engine.input_processor.tokenizer(prompt)["input_ids"]])
    with pytest.raises(ImageCountMismatchError):  # the expanded rows: runs broken by [IMG_BREAK]
        engine.generate({"prompt_token_ids": text.prompt_token_ids, "multi_modal_data": {"image": [WIDE, TALL]}},
                        sampling_params=GREEDY, use_tqdm=False)


def test_pictures_across_chunk_boundaries(path):
    """Chunks of 12 tokens end inside both pictures' runs (24 and 72 tokens)."""
    items, _ = check_pictures_across_chunks(path, mistral3_prompt(QUESTION, 2), [WIDE, TALL], 12)
    assert len(items) == 2


def test_a_mixed_batch_equals_each_prompt_alone(uncached):
    prompts = [mistral3_prompt(QUESTION, 0), mistral3_prompt("What is it?", 1), mistral3_prompt("Compare them.", 2),
               mistral3_prompt("And this one?", 1)]
    check_mixed_batch(uncached, prompts, [None, [SMALL], [TALL, WIDE], [TALL]])


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(path, engine):
    check_repeated_prompt(path, engine, mistral3_prompt(QUESTION, 1), [make_test_image(7, (70, 40))])


def test_a_picture_at_every_offset_from_a_block_boundary(path, uncached):
    """The picture after 0 to 4 words of the turn, and 0 to 4 words after it."""
    prompts = [mistral3_prompt("a " * after + "What is it?", 0).replace("[INST]", "[INST]" + "b " * before + "[IMG]", 1)
               for before, after in [(0, 0), (1, 0), (2, 0), (4, 0), (1, 4), (3, 2)]]
    assert check_every_block_offset(tiny_engine(path, encoder_cache_size=1), uncached, prompts, [WIDE]) == 1


def test_preemption_keeps_the_tokens(path):
    """Two prompts that share no block, each 14 blocks of 4 and 17 once generated, in 30 blocks: both are
    admitted and one is preempted as they grow."""
    check_preemption(path, [text + mistral3_prompt(QUESTION, 1) for text in ("One.", "Two!")], [WIDE], 30)


def test_bad_inputs_are_typed_errors(engine):
    check_bad_inputs(engine, mistral3_prompt("What?", 1), [WIDE, TALL], embeds_width=64)


def test_both_key_layouts_load_strictly(path, engine, tmp_path):
    """The published files (language_model.model.*, language_model.lm_head.*, vision_tower.*) and transformers 5's
    (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*, lm_head.*) give the same tokens;
    a missing merger tensor is named."""
    check_both_key_layouts(path, engine, tmp_path, mistral3_prompt("What is it?", 1), [WIDE],
                           "model.multi_modal_projector.patch_merger.merging_layer.weight", "merging_layer")


def test_demo_and_budget(path, tmp_path, capsys):
    assert "at most 72" in check_demo_and_budget("mistral3", path, tmp_path, capsys)
