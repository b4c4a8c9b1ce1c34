"""Mistral 3 end to end against transformers (fp32, CPU): the tiny checkpoint's Pixtral tower takes 4 px patches at
the picture's native resolution (longest edge at most 64 px), merged 2x2 into 8 px tokens, over a Mistral decoder.
Greedy tokens equal transformers' generate for text, one picture and two pictures of different sizes and aspect
ratios, top logprobs are close; the prompt's [IMG] / [IMG_BREAK] / [IMG_END] rows and the pixels equal
transformers' model inputs (its PIL image processor; the rows as PixtralProcessor.replace_image_token writes them,
rebuilt here since PixtralProcessor needs torchvision); a picture across prefill-chunk boundaries, a mixed batch, a
prefix hit with one encoder run, the divisible-block matrix, preemption, both key layouts, typed errors, demo and
budget."""

from __future__ import annotations

import shutil

import pytest
import torch
from books import assert_books_consistent
from conftest import hf_greedy, hf_logits
from helpers import record_prefill_chunks
from safetensors.torch import load_file, save_file

from mmengine import MMEngine, SamplingParams
from mmengine.errors import ImageCountMismatchError, InvalidInputError, WeightsMismatchError
from mmengine.testing.images import make_test_image
from mmengine.testing.mistral3 import mistral3_prompt, tiny_mistral3_path

WIDE, TALL, SMALL = make_test_image(3, (90, 30)), make_test_image(4, (50, 70)), make_test_image(5, (20, 20))
QUESTION = "Describe the picture in detail."
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return tiny_mistral3_path()


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


@pytest.mark.parametrize("pictures", [[], [WIDE], [WIDE, TALL]], ids=["text", "wide", "wide,tall"])
def test_greedy_tokens_equal_transformers(path, engine, pictures):
    prompt = mistral3_prompt(QUESTION, len(pictures))
    assert _greedy(engine, prompt, pictures or None) == [hf_greedy(path, prompt, pictures, 12, ignore_eos=True)]


def test_top_logprobs_are_close(path, uncached):
    prompt = mistral3_prompt(QUESTION, 2)
    want = torch.log_softmax(hf_logits(path, prompt, [TALL, WIDE]), -1).topk(5)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    top = uncached.generate(prompt, images=[TALL, WIDE], sampling_params=params, use_tqdm=False)[0].logprobs[0].top
    assert [token for token, _ in top] == want.indices.tolist()
    assert (torch.tensor([logprob for _, logprob in top]) - want.values).abs().max() < 1e-4
    other = torch.log_softmax(hf_logits(path, prompt, [WIDE, TALL]), -1)
    assert (other - torch.log_softmax(hf_logits(path, prompt, [TALL, WIDE]), -1)).abs().max() > 1e-2  # the pictures matter


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
    text = engine.generate(prompt, images=[WIDE, TALL], sampling_params=GREEDY, use_tqdm=False)[0]
    ids = engine.input_processor.tokenizer(prompt)["input_ids"]
    tokens = engine.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [WIDE, TALL]}},
                             sampling_params=GREEDY, use_tqdm=False)[0]
    assert tokens.prompt_token_ids == text.prompt_token_ids and tokens.token_ids == text.token_ids
    with pytest.raises(ImageCountMismatchError):  # the expanded rows: runs broken by [IMG_BREAK]
        engine.generate({"prompt_token_ids": text.prompt_token_ids, "multi_modal_data": {"image": [WIDE, TALL]}},
                        sampling_params=GREEDY, use_tqdm=False)


def test_pictures_across_chunk_boundaries(path):
    """Chunks of 12 tokens end inside both pictures' runs (24 and 72 tokens)."""
    prompt = mistral3_prompt(QUESTION, 2)
    engine = _engine(path, max_num_batched_tokens=12)
    chunks = record_prefill_chunks(engine)
    assert _greedy(engine, prompt, [WIDE, TALL]) == [hf_greedy(path, prompt, [WIDE, TALL], 12, ignore_eos=True)]
    for item in engine.input_processor.process(prompt, [WIDE, TALL], GREEDY).mm_items:
        assert any(item.offset < end < item.end for _, end in chunks)
    assert engine.stats()["encoder_runs"] == 2


def test_a_mixed_batch_equals_each_prompt_alone(uncached):
    prompts = [mistral3_prompt(QUESTION, 0), mistral3_prompt("What is it?", 1), mistral3_prompt("Compare them.", 2),
               mistral3_prompt("And this one?", 1)]
    images = [None, [SMALL], [TALL, WIDE], [TALL]]
    batch = _greedy(uncached, prompts, images)
    assert batch == [_greedy(uncached, prompt, image)[0] for prompt, image in zip(prompts, images)]


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(path, engine):
    prompt = mistral3_prompt(QUESTION, 1)
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


def test_a_picture_at_every_offset_from_a_block_boundary(path, uncached):
    """The divisible-block matrix: the picture starts at each offset from a block boundary, prompts whose length
    the block size divides included, at the smallest encoder budget (one picture); identical requests twice and
    once more equal prefix caching off. One encoder run, no re-encode after a prefix hit."""
    cached = _engine(path, encoder_cache_size=1)
    assert cached.encoder_budget.compute_budget_tokens == cached.family.max_tokens_per_item()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    offsets, lengths = set(), set()
    for before, after in [(0, 0), (1, 0), (2, 0), (4, 0), (1, 4), (3, 2)]:
        text = "a " * after + "What is it?"
        prompt = mistral3_prompt(text, 0).replace("[INST]", "[INST]" + "b " * before + "[IMG]", 1)
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
    """Two prompts that share no block, each 14 blocks of 4 and 17 once generated, in 30 blocks: both are
    admitted and one is preempted as they grow."""
    prompts = [text + mistral3_prompt(QUESTION, 1) for text in ("One.", "Two!")]
    tight = _engine(path, num_kv_blocks=30, max_num_seqs=4)
    outputs = _greedy(tight, prompts, [[WIDE]] * 2)
    assert tight.scheduler.num_preemptions > 0
    assert_books_consistent(tight)
    assert outputs == [hf_greedy(path, prompt, [WIDE], 12, ignore_eos=True) for prompt in prompts]


def test_bad_inputs_are_typed_errors(engine):
    with pytest.raises(ImageCountMismatchError):
        engine.generate(mistral3_prompt("What?", 1), images=[WIDE, TALL], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="image_embeds"):
        engine.generate(mistral3_prompt("What?", 1), images=[{"image_embeds": torch.zeros(4, 64)}],
                        sampling_params=GREEDY, use_tqdm=False)


def test_both_key_layouts_load_strictly(path, engine, tmp_path):
    """The published files (language_model.model.*, language_model.lm_head.*, vision_tower.*) and transformers 5's
    (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*, lm_head.*) give the same tokens;
    a missing merger tensor is named."""
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
    prompt = mistral3_prompt("What is it?", 1)
    assert _greedy(_engine(new), prompt, [WIDE]) == _greedy(engine, prompt, [WIDE])
    missing = shutil.copytree(path, tmp_path / "missing", ignore=shutil.ignore_patterns("model.safetensors"))
    del renamed["model.multi_modal_projector.patch_merger.merging_layer.weight"]
    save_file(renamed, str(missing / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsMismatchError, match="merging_layer"):
        _engine(missing)


def test_demo_and_budget(path, tmp_path, capsys):
    from mmengine.cli import main

    assert main(["demo", "--family", "mistral3", "--requests", "4", "--max-tokens", "2", "--cache-dir", str(tmp_path)]) == 0
    assert "tiny mistral3 checkpoint" in capsys.readouterr().out
    assert main(["budget", "--model", str(path), "--device", "cpu", "--max-model-len", "512", "--block-size", "4"]) == 0
    assert "at most 72" in capsys.readouterr().out
