"""InternVL 3.5 end to end against transformers (fp32, CPU): the tiny checkpoint cuts pictures into 32 px tiles
of 4x4 patches (pixel-shuffled to 4 tokens a tile), 1 to 6 tiles plus a thumbnail, over a Qwen3 decoder.
Greedy tokens equal transformers' generate for text, one picture and two pictures of different tile counts;
the prompt and pixels are transformers' processor's (the PIL GOT-OCR2 image processor: no torchvision); a
picture across prefill-chunk boundaries, a mixed batch, a prefix hit with one encoder run per picture (all its
tiles), hashing on the tiling settings, preemption; both key layouts load strictly; videos are refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy
from family_checks import (GREEDY, TILE_PROBE_SIZES, against_the_processor, check_bad_inputs, check_both_key_layouts,
                           check_demo_and_budget, check_every_block_offset, check_hash_follows_a_setting, check_mixed_batch,
                           check_pictures_across_chunks, check_preemption, check_repeated_prompt, check_token_prompts,
                           check_top_logprobs, engine_fixtures, greedy, tiny_engine)

from mmengine.errors import InvalidInputError
from mmengine.testing.images import make_test_image
from mmengine.testing.internvl import internvl_prompt, tiny_internvl_path

WIDE, TALL, SMALL = make_test_image(3, (90, 30)), make_test_image(4, (50, 70)), make_test_image(5, (20, 20))
QUESTION = "Describe the picture in detail."

path, engine, uncached = engine_fixtures(tiny_internvl_path)


@pytest.mark.parametrize("pictures", [[], [WIDE], [SMALL], [WIDE, TALL]], ids=["text", "1x3+thumb", "1x1", "1x3+thumb,3x2+thumb"])
def test_greedy_tokens_equal_transformers(path, engine, pictures):
    """A 90x30 picture makes 1x3 tiles and the thumbnail, a 50x70 one 3 rows of 2 and the thumbnail, a 20x20 one
    a single tile (no thumbnail)."""
    tiles = [engine.family.num_tiles(picture.height, picture.width) for picture in pictures]
    assert tiles == {0: [], 1: [4] if pictures == [WIDE] else [1], 2: [4, 7]}[len(pictures)]
    prompt = internvl_prompt(QUESTION, len(pictures))
    assert greedy(engine, prompt, pictures or None) == [hf_greedy(path, prompt, pictures, 12, ignore_eos=True)]


def test_top_logprobs_are_close(path, uncached):
    check_top_logprobs(uncached, path, internvl_prompt(QUESTION, 2), [TALL, WIDE], pictures_matter=True)


def test_prompt_and_pixels_are_transformers(engine):
    """The `<img>` run `</img>` and every tile equal InternVLProcessor's for sizes around the tile and odd ratios."""
    for width, height, processed, reference in against_the_processor(engine, internvl_prompt("What?", 1), TILE_PROBE_SIZES):
        (item,) = processed.mm_items
        assert torch.equal(item.encoder_inputs["pixel_values"], reference["pixel_values"])
        assert engine.family.num_tiles(height, width) == reference["pixel_values"].shape[0]


def test_a_token_prompt_gives_the_text_prompts_tokens(engine):
    """One `<IMG_CONTEXT>` per picture in a token prompt is expanded as the processor expands the marker; the
    processor's expanded ids are taken as they are."""
    prompt = internvl_prompt("Compare them.", 2)
    markers = engine.input_processor.tokenizer(prompt)["input_ids"]
    expanded = engine.input_processor.hf_processor(text=prompt, images=[WIDE, TALL])["input_ids"][0]
    check_token_prompts(engine, prompt, [WIDE, TALL], [markers, expanded])


def test_precomputed_embeddings_stand_for_a_picture(engine):
    """A picture's image_embeds (all its tiles' runs, the tower's output for WIDE here) give its tokens; rows that
    are not whole tiles' runs are an InvalidInputError."""
    prompt = internvl_prompt("Compare them.", 2)
    text = engine.generate(prompt, images=[WIDE, TALL], sampling_params=GREEDY, use_tqdm=False)[0]
    item = engine.input_processor.process(prompt, [WIDE, TALL], GREEDY).mm_items[0]
    embeds = engine.runner.model.encode_items([item.encoder_inputs])[0]
    assert embeds.shape[0] == 16
    tokens = engine.generate(prompt, images=[{"image_embeds": embeds}, TALL], sampling_params=GREEDY, use_tqdm=False)[0]
    assert tokens.prompt_token_ids == text.prompt_token_ids and tokens.token_ids == text.token_ids
    with pytest.raises(InvalidInputError, match="image_embeds has 15 rows"):
        engine.generate(prompt, images=[{"image_embeds": embeds[:15]}, TALL], sampling_params=GREEDY, use_tqdm=False)


def test_pictures_across_chunk_boundaries(path):
    """Chunks of 12 tokens end inside both pictures' runs (16 and 28 tokens)."""
    items, _ = check_pictures_across_chunks(path, internvl_prompt(QUESTION, 2), [WIDE, TALL], 12)
    assert len(items) == 2


def test_a_mixed_batch_equals_each_prompt_alone(uncached):
    prompts = [internvl_prompt(QUESTION, 0), internvl_prompt("What is it?", 1), internvl_prompt("Compare them.", 2),
               internvl_prompt("And this one?", 1)]
    check_mixed_batch(uncached, prompts, [None, [SMALL], [TALL, WIDE], [TALL]])


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(path, engine):
    """One encoder run and one encoder-cache entry per picture (all its tiles), none for the repeat, whose prompt
    is a prefix hit but for its last block."""
    check_repeated_prompt(path, engine, internvl_prompt(QUESTION, 1), [make_test_image(7, (70, 40))])


def test_the_item_is_hashed_on_the_picture_and_the_tiling_settings(engine, path):
    check_hash_follows_a_setting(engine, path, internvl_prompt("What?", 1), WIDE, "max_patches", 2,
                                 ['"max_patches": 6', '"crop_to_patches": true'])


def test_a_picture_at_every_offset_from_a_block_boundary(path, uncached):
    prompts = ["a " * pad + internvl_prompt("What is it?", 1) for pad in range(5)]
    assert check_every_block_offset(tiny_engine(path, encoder_cache_size=1), uncached, prompts, [WIDE]) == 1


def test_preemption_keeps_the_tokens(path):
    """Two prompts that share no block, each 15 blocks of 4 and 18 once generated, in 33 blocks: both are
    admitted and one is preempted as they grow."""
    check_preemption(path, [text + internvl_prompt(QUESTION, 1) for text in ("One.", "Two!")], [WIDE], 33)


def test_bad_inputs_are_typed_errors(engine):
    check_bad_inputs(engine, internvl_prompt("What?", 1), [WIDE, TALL], video_prompt=internvl_prompt("What happens?") + "<video>")


def test_both_key_layouts_load_strictly(path, engine, tmp_path):
    """The published files (language_model.model.*, language_model.lm_head.*, vision_tower.*) and transformers 5's
    (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*, lm_head.*) give the same tokens;
    a missing projector tensor is named."""
    check_both_key_layouts(path, engine, tmp_path, internvl_prompt("What is it?", 1), [WIDE],
                           "model.multi_modal_projector.linear_1.weight", "linear_1")


def test_demo_and_budget(path, tmp_path, capsys):
    shown = check_demo_and_budget("internvl", path, tmp_path, capsys)
    assert "1..6 tiles plus a thumbnail" in shown and "at most 28" in shown
