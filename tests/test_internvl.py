"""InternVL 3.5 end to end against transformers (fp32, CPU): the tiny checkpoint cuts pictures into 32 px tiles
of 4x4 patches (pixel-shuffled to 4 tokens a tile), 1 to 6 tiles plus a thumbnail, over a Qwen3 decoder.
Greedy tokens equal transformers' generate for text, one picture and two pictures of different tile counts;
the prompt and pixels are transformers' processor's (the PIL GOT-OCR2 image processor: no torchvision); a
picture across prefill-chunk boundaries, a mixed batch, a prefix hit with one encoder run per picture (all its
tiles), hashing on the tiling settings, preemption; both key layouts load strictly; videos are refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from books import assert_books_consistent
from conftest import hf_greedy, hf_logits
from helpers import record_prefill_chunks
from safetensors.torch import load_file, save_file

from mmengine import MMEngine, SamplingParams
from mmengine.encoder_cache.hashing import hash_image, model_fingerprint, processor_settings_key
from mmengine.errors import ImageCountMismatchError, InvalidInputError, WeightsMismatchError
from mmengine.multimodal.video import Video
from mmengine.testing.images import make_test_image
from mmengine.testing.internvl import internvl_prompt, tiny_internvl_path

WIDE, TALL, SMALL = make_test_image(3, (90, 30)), make_test_image(4, (50, 70)), make_test_image(5, (20, 20))
QUESTION = "Describe the picture in detail."
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return tiny_internvl_path()


def _engine(path, **kwargs) -> MMEngine:
    options = dict(device="cpu", dtype="float32", max_model_len=512, enforce_eager=True, block_size=4)
    return MMEngine(str(path), **{**options, **kwargs})


@pytest.fixture(scope="module")
def engine(path) -> MMEngine:
    return _engine(path)


@pytest.fixture(scope="module")
def uncached(path) -> MMEngine:
    return _engine(path, enable_prefix_caching=False)


def _greedy(engine: MMEngine, prompts, images, params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    return [output.token_ids for output in outputs]


@pytest.mark.parametrize("pictures", [[], [WIDE], [SMALL], [WIDE, TALL]], ids=["text", "1x3+thumb", "1x1", "1x3+thumb,3x2+thumb"])
def test_greedy_tokens_equal_transformers(path, engine, pictures):
    """A 90x30 picture makes 1x3 tiles and the thumbnail, a 50x70 one 3 rows of 2 and the thumbnail, a 20x20 one
    a single tile (no thumbnail)."""
    tiles = [engine.family.num_tiles(picture.height, picture.width) for picture in pictures]
    assert tiles == {0: [], 1: [4] if pictures == [WIDE] else [1], 2: [4, 7]}[len(pictures)]
    prompt = internvl_prompt(QUESTION, len(pictures))
    assert _greedy(engine, prompt, pictures or None) == [hf_greedy(path, prompt, pictures, 12, ignore_eos=True)]


def test_top_logprobs_are_close(path, uncached):
    prompt = internvl_prompt(QUESTION, 2)
    want = torch.log_softmax(hf_logits(path, prompt, [TALL, WIDE]), -1).topk(5)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    top = uncached.generate(prompt, images=[TALL, WIDE], sampling_params=params, use_tqdm=False)[0].logprobs[0].top
    assert [token for token, _ in top] == want.indices.tolist()
    assert (torch.tensor([logprob for _, logprob in top]) - want.values).abs().max() < 1e-4
    other = torch.log_softmax(hf_logits(path, prompt, [WIDE, TALL]), -1)
    assert (other - torch.log_softmax(hf_logits(path, prompt, [TALL, WIDE]), -1)).abs().max() > 1e-2  # the pictures matter


def test_prompt_and_pixels_are_transformers(engine):
    """The `<img>` run `</img>` and every tile equal InternVLProcessor's for sizes around the tile and odd ratios."""
    processor = engine.input_processor
    for index, (width, height) in enumerate([(5, 90), (31, 33), (32, 32), (40, 64), (65, 17), (97, 96), (200, 30), (120, 250)]):
        picture = make_test_image(index, (width, height))
        prompt = internvl_prompt("What?", 1)
        reference = processor.hf_processor(text=prompt, images=[picture], return_tensors="pt")
        processed = processor.process(prompt, [picture], GREEDY)
        assert processed.prompt_token_ids == reference["input_ids"][0].tolist()
        (item,) = processed.mm_items
        assert torch.equal(item.encoder_inputs["pixel_values"], reference["pixel_values"])
        assert engine.family.num_tiles(height, width) == reference["pixel_values"].shape[0]


def test_a_token_prompt_gives_the_text_prompts_tokens(engine):
    """One `<IMG_CONTEXT>` per picture in a token prompt is expanded as the processor expands the marker; the
    processor's expanded ids are taken as they are."""
    prompt = internvl_prompt("Compare them.", 2)
    text = engine.generate(prompt, images=[WIDE, TALL], sampling_params=GREEDY, use_tqdm=False)[0]
    markers = engine.input_processor.tokenizer(prompt)["input_ids"]
    expanded = engine.input_processor.hf_processor(text=prompt, images=[WIDE, TALL])["input_ids"][0]
    for ids in (markers, expanded):
        tokens = engine.generate({"prompt_token_ids": list(ids), "multi_modal_data": {"image": [WIDE, TALL]}},
                                 sampling_params=GREEDY, use_tqdm=False)[0]
        assert tokens.prompt_token_ids == text.prompt_token_ids and tokens.token_ids == text.token_ids


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
    prompt = internvl_prompt(QUESTION, 2)
    engine = _engine(path, max_num_batched_tokens=12)
    chunks = record_prefill_chunks(engine)
    assert _greedy(engine, prompt, [WIDE, TALL]) == [hf_greedy(path, prompt, [WIDE, TALL], 12, ignore_eos=True)]
    for item in engine.input_processor.process(prompt, [WIDE, TALL], GREEDY).mm_items:
        assert any(item.offset < end < item.end for _, end in chunks)
    assert engine.stats()["encoder_runs"] == 2


def test_a_mixed_batch_equals_each_prompt_alone(uncached):
    prompts = [internvl_prompt(QUESTION, 0), internvl_prompt("What is it?", 1), internvl_prompt("Compare them.", 2),
               internvl_prompt("And this one?", 1)]
    images = [None, [SMALL], [TALL, WIDE], [TALL]]
    batch = _greedy(uncached, prompts, images)
    assert batch == [_greedy(uncached, prompt, image)[0] for prompt, image in zip(prompts, images)]


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(path, engine):
    """One encoder run and one encoder-cache entry per picture (all its tiles), none for the repeat, whose prompt
    is a prefix hit but for its last block."""
    prompt = internvl_prompt(QUESTION, 1)
    picture = [make_test_image(7, (70, 40))]
    before = engine.stats()
    first = _greedy(engine, prompt, picture)
    middle = engine.stats()
    again = engine.generate(prompt, images=picture, sampling_params=GREEDY, use_tqdm=False)[0]
    after = engine.stats()
    assert again.token_ids == first[0] == hf_greedy(path, prompt, picture, 12, ignore_eos=True)
    assert middle["encoder_runs"] == before["encoder_runs"] + 1 and after["encoder_runs"] == middle["encoder_runs"]
    assert middle["encoder_cache_entries"] - before["encoder_cache_entries"] <= 1
    prompt_len = len(again.prompt_token_ids)
    assert after["prefix_cache_hits"] - middle["prefix_cache_hits"] >= prompt_len - 4
    assert after["prefill_tokens_computed"] - middle["prefill_tokens_computed"] <= 4
    assert again.num_cached_tokens >= prompt_len - 4 and after["reencodes_after_prefix_hit"] == 0


def test_the_item_is_hashed_on_the_picture_and_the_tiling_settings(engine, path):
    processor = engine.input_processor
    (item,) = processor.process(internvl_prompt("What?", 1), [WIDE], GREEDY).mm_items
    image_processor = processor.hf_processor.image_processor
    settings = processor_settings_key(image_processor)
    assert item.mm_hash == hash_image(WIDE.convert("RGB"), model_fingerprint(path), settings)
    assert '"max_patches": 6' in settings and '"crop_to_patches": true' in settings
    original = image_processor.max_patches
    try:
        image_processor.max_patches = 2
        assert hash_image(WIDE.convert("RGB"), model_fingerprint(path), processor_settings_key(image_processor)) != item.mm_hash
    finally:
        image_processor.max_patches = original


def test_a_picture_at_every_offset_from_a_block_boundary(path, uncached):
    """The divisible-block matrix: the picture starts at each offset from a block boundary, prompts whose length
    the block size divides included, at the smallest encoder budget (one picture); identical requests twice and
    once more equal prefix caching off. One encoder run, no re-encode after a prefix hit."""
    cached = _engine(path, encoder_cache_size=1)
    assert cached.encoder_budget.compute_budget_tokens == cached.family.max_tokens_per_item()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    offsets, lengths = set(), set()
    for pad in range(5):
        prompt = "a " * pad + internvl_prompt("What is it?", 1)
        first = cached.generate([prompt] * 2, images=[[WIDE]] * 2, sampling_params=params, use_tqdm=False)
        again = cached.generate(prompt, images=[WIDE], sampling_params=params, use_tqdm=False)
        reference = uncached.generate(prompt, images=[WIDE], sampling_params=params, use_tqdm=False)
        assert [o.token_ids for o in first + again] == [reference[0].token_ids] * 3
        assert again[0].num_cached_tokens > 0
        offsets.add(cached.input_processor.process(prompt, [WIDE], params).mm_items[0].offset % 4)
        lengths.add(len(reference[0].prompt_token_ids) % 4)
    assert offsets == {0, 1, 2, 3} and 0 in lengths
    stats = cached.stats()
    assert stats["encoder_runs"] == 1 and stats["reencodes_after_prefix_hit"] == 0


def test_preemption_keeps_the_tokens(path):
    """Two prompts that share no block, each 15 blocks of 4 and 18 once generated, in 33 blocks: both are
    admitted and one is preempted as they grow."""
    prompts = [text + internvl_prompt(QUESTION, 1) for text in ("One.", "Two!")]
    tight = _engine(path, num_kv_blocks=33, max_num_seqs=4)
    outputs = _greedy(tight, prompts, [[WIDE]] * 2)
    assert tight.scheduler.num_preemptions > 0
    assert_books_consistent(tight)
    assert outputs == [hf_greedy(path, prompt, [WIDE], 12, ignore_eos=True) for prompt in prompts]


def test_bad_inputs_are_typed_errors(engine):
    with pytest.raises(ImageCountMismatchError):
        engine.generate(internvl_prompt("What?", 1), images=[WIDE, TALL], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="takes no videos"):
        engine.generate({"prompt": internvl_prompt("What happens?") + "<video>",
                         "multi_modal_data": {"video": Video(torch.zeros(2, 32, 32, 3, dtype=torch.uint8).numpy())}},
                        sampling_params=GREEDY, use_tqdm=False)


def test_both_key_layouts_load_strictly(path, engine, tmp_path):
    """The published files (language_model.model.*, language_model.lm_head.*, vision_tower.*) and transformers 5's
    (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*, lm_head.*) give the same tokens;
    a missing projector tensor is named."""
    tensors = load_file(str(path / "model.safetensors"))
    assert any(name.startswith("language_model.model.") for name in tensors)
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("language_model.lm_head."):
            renamed[name.removeprefix("language_model.")] = tensor
        elif name.startswith("language_model.model."):
            renamed["model.language_model." + name.removeprefix("language_model.model.")] = tensor
        else:
            renamed["model." + name] = tensor
    new = shutil.copytree(path, tmp_path / "v5", ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(renamed, str(new / "model.safetensors"), metadata={"format": "pt"})
    prompt = internvl_prompt("What is it?", 1)
    assert _greedy(_engine(new), prompt, [WIDE]) == _greedy(engine, prompt, [WIDE])
    missing = shutil.copytree(path, tmp_path / "missing", ignore=shutil.ignore_patterns("model.safetensors"))
    del renamed["model.multi_modal_projector.linear_1.weight"]
    save_file(renamed, str(missing / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsMismatchError, match="linear_1"):
        _engine(missing)


def test_demo_and_budget(path, tmp_path, capsys):
    from mmengine.cli import main

    assert main(["demo", "--family", "internvl", "--requests", "4", "--max-tokens", "2", "--cache-dir", str(tmp_path)]) == 0
    assert "tiny internvl checkpoint" in capsys.readouterr().out
    assert main(["budget", "--model", str(path), "--device", "cpu", "--max-model-len", "512", "--block-size", "4"]) == 0
    shown = capsys.readouterr().out
    assert "1..6 tiles plus a thumbnail" in shown and "at most 28" in shown
