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
from books import assert_books_consistent
from conftest import hf_greedy, hf_logits
from helpers import record_prefill_chunks
from safetensors.torch import load_file, save_file

from mmengine import MMEngine, SamplingParams
from mmengine.encoder_cache.hashing import hash_image, hash_image_part, model_fingerprint, processor_settings_key
from mmengine.errors import ImageCountMismatchError, InvalidInputError, UnsupportedModelError, WeightsMismatchError
from mmengine.multimodal.video import Video
from mmengine.testing.images import make_test_image
from mmengine.testing.smolvlm import IDEFICS3_SPEC, SMOLVLM_SPEC, smolvlm_prompt, tiny_smolvlm_path

WIDE, TALL, SQUARE = make_test_image(3, (64, 40)), make_test_image(4, (30, 90)), make_test_image(7, (50, 50))
QUESTION = "Describe the picture in detail."
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SPECS = {"idefics3": IDEFICS3_SPEC, "smolvlm": SMOLVLM_SPEC}
# Each family's grids (rows, cols) for WIDE and TALL: different grids within one prompt
GRIDS = {"idefics3": [(2, 3), (3, 1)], "smolvlm": [(2, 2), (2, 1)]}


def _engine(path: Path, **kwargs) -> MMEngine:
    options = dict(device="cpu", dtype="float32", max_model_len=1024, enforce_eager=True, block_size=4)
    return MMEngine(str(path), **{**options, **kwargs})


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


def _greedy(engine: MMEngine, prompts, images, params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    return [output.token_ids for output in outputs]


@pytest.mark.parametrize("pictures", [[], [WIDE], [WIDE, TALL]], ids=["text", "one", "two-grids"])
def test_greedy_tokens_equal_transformers(case, pictures):
    grids = [case.engine.family.tiles.grid(picture.height, picture.width) for picture in pictures]
    assert grids == GRIDS[case.family][:len(pictures)]
    prompt = case.prompt(QUESTION, len(pictures))
    assert _greedy(case.engine, prompt, pictures or None) == [hf_greedy(case.path, prompt, pictures, 12, ignore_eos=True)]


def test_the_prompt_and_pixels_are_transformers(case):
    """For sizes around the tile and odd aspect ratios: the prompt's ids equal transformers' processor's (the
    row/column markers, the global image, each run), each item is a tile (then the global image) of its
    pixels, and the grid agrees with the family's own rule (the resize guard's)."""
    processor = case.engine.input_processor
    for index, (width, height) in enumerate([(5, 90), (31, 33), (32, 32), (64, 65), (200, 30), (120, 250)]):
        picture = make_test_image(index, (width, height))
        prompt = case.prompt("What?", 1)
        reference = processor.hf_processor(text=prompt, images=[picture], return_tensors="pt")
        processed = processor.process(prompt, [picture], GREEDY)
        assert processed.prompt_token_ids == reference["input_ids"][0].tolist()
        pixels = torch.stack([item.encoder_inputs["pixel_values"] for item in processed.mm_items])
        assert torch.equal(pixels, reference["pixel_values"][0])
        rows, cols = case.engine.family.tiles.grid(height, width)
        assert len(processed.mm_items) == rows * cols + 1
        assert all(item.length == 16 for item in processed.mm_items)


def test_top_logprobs_are_close(case):
    prompt = case.prompt(QUESTION, 2)
    want = torch.log_softmax(hf_logits(case.path, prompt, [TALL, WIDE]), -1).topk(5)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    top = case.engine.generate(prompt, images=[TALL, WIDE], sampling_params=params, use_tqdm=False)[0].logprobs[0].top
    assert [token for token, _ in top] == want.indices.tolist()
    assert (torch.tensor([logprob for _, logprob in top]) - want.values).abs().max() < 1e-4


def test_tiles_across_chunk_boundaries(case):
    """Chunks of 24 tokens end inside tiles' runs (causal attention: a chunk may split a tile, whose encoder
    output is computed once and read by each chunk); one encoder run per tile."""
    prompt = case.prompt(QUESTION, 2)
    engine = _engine(case.path, max_num_batched_tokens=24)
    chunks = record_prefill_chunks(engine)
    assert _greedy(engine, prompt, [WIDE, TALL]) == [hf_greedy(case.path, prompt, [WIDE, TALL], 12, ignore_eos=True)]
    items = engine.input_processor.process(prompt, [WIDE, TALL], GREEDY).mm_items
    assert sum(any(item.offset < end < item.end for _, end in chunks) for item in items) >= 2
    assert engine.stats()["encoder_runs"] == len(items)


def test_a_mixed_batch_equals_each_prompt_alone(idefics3):
    engine = idefics3.engine
    prompts = [idefics3.prompt(QUESTION, 0), idefics3.prompt("What is it?", 1), idefics3.prompt("Compare them.", 2),
               idefics3.prompt("And this one?", 1)]
    images = [None, [SQUARE], [TALL, WIDE], [TALL]]
    batch = _greedy(engine, prompts, images)
    assert batch == [_greedy(engine, prompt, image)[0] for prompt, image in zip(prompts, images)]


def test_a_picture_at_every_offset_from_a_block_boundary(idefics3):
    """The divisible-block matrix (vLLM's #11895): the picture starts at each offset from a block boundary,
    prompts whose length the block size divides included, at the smallest encoder budget (one tile);
    identical requests twice and once more equal prefix caching off. One encoder run per tile, no re-encode
    after a prefix hit."""
    cached = _engine(idefics3.path, encoder_cache_size=1)
    assert cached.encoder_budget.compute_budget_tokens == cached.family.max_tokens_per_item() == 16
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    offsets, lengths = set(), set()
    for pad in range(5):
        prompt = "a " * pad + idefics3.prompt("What is it?", 1)
        first = cached.generate([prompt] * 2, images=[[TALL]] * 2, sampling_params=params, use_tqdm=False)
        again = cached.generate(prompt, images=[TALL], sampling_params=params, use_tqdm=False)
        reference = _greedy(idefics3.engine, prompt, [TALL], params)
        assert [o.token_ids for o in first + again] == reference * 3
        assert again[0].num_cached_tokens > 0
        items = cached.input_processor.process(prompt, [TALL], params).mm_items
        offsets.add(items[0].offset % 4)
        lengths.add(len(again[0].prompt_token_ids) % 4)
    assert offsets == {0, 1, 2, 3} and 0 in lengths
    stats = cached.stats()
    assert stats["encoder_runs"] == len(items) == 4 and stats["reencodes_after_prefix_hit"] == 0


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(case):
    """One encoder run per tile and one for the global image (each its own encoder-cache entry), none for the
    repeat, whose prompt is a prefix hit but for its last block."""
    engine, prompt, picture = case.engine, case.prompt(QUESTION, 1), [make_test_image(11, (70, 40))]
    num_items = len(engine.input_processor.process(prompt, picture, GREEDY).mm_items)
    before = engine.stats()
    first = _greedy(engine, prompt, picture)
    middle = engine.stats()
    again = engine.generate(prompt, images=picture, sampling_params=GREEDY, use_tqdm=False)[0]
    after = engine.stats()
    assert again.token_ids == first[0] == hf_greedy(case.path, prompt, picture, 12, ignore_eos=True)
    assert num_items > 1 and middle["encoder_runs"] == before["encoder_runs"] + num_items
    assert after["encoder_runs"] == middle["encoder_runs"] and after["reencodes_after_prefix_hit"] == before["reencodes_after_prefix_hit"]
    prompt_len = len(again.prompt_token_ids)
    assert after["prefix_cache_hits"] - middle["prefix_cache_hits"] >= prompt_len - 4
    assert after["prefill_tokens_computed"] - middle["prefill_tokens_computed"] <= 4  # at most the last block
    assert again.num_cached_tokens >= prompt_len - 4


def test_preemption_keeps_the_tokens(idefics3):
    """Two prompts that share no block, each 43 blocks of 4 and 46 once generated, in 88 blocks: both are
    admitted and one is preempted as they grow."""
    prompts = [text + idefics3.prompt(QUESTION, 1) for text in ("One.", "Two!")]
    tight = _engine(idefics3.path, num_kv_blocks=88, max_num_seqs=4)
    outputs = _greedy(tight, prompts, [[WIDE]] * 2)
    assert tight.scheduler.num_preemptions > 0
    assert_books_consistent(tight)
    assert outputs == [hf_greedy(idefics3.path, prompt, [WIDE], 12, ignore_eos=True) for prompt in prompts]


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
    assert _greedy(unsplit, prompt, [WIDE, TALL]) == [expected]
    # a token prompt holding the processor's expanded ids (one run a picture when not split)
    ids = unsplit.input_processor.hf_processor(text=prompt, images=[WIDE, TALL])["input_ids"][0]
    tokens = unsplit.generate({"prompt_token_ids": list(ids), "multi_modal_data": {"image": [WIDE, TALL]}}, sampling_params=GREEDY,
                              use_tqdm=False)[0]
    assert tokens.prompt_token_ids == processed.prompt_token_ids and tokens.token_ids == expected
    # precomputed embeddings stand for a picture that is not split (the tower's output for WIDE here)
    embeds = unsplit.runner.model.encode_items([processed.mm_items[0].encoder_inputs])[0]
    assert _greedy(unsplit, prompt, [{"image_embeds": embeds}, TALL]) == [expected]
    with pytest.raises(InvalidInputError, match="image_embeds has 32 rows"):
        _greedy(unsplit, prompt, [{"image_embeds": torch.cat([embeds, embeds])}, TALL])
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
    assert chat.token_ids == _greedy(case.engine, prompt, [SQUARE])[0]


def test_bad_inputs_are_typed_errors(case):
    engine = case.engine
    with pytest.raises(ImageCountMismatchError, match="1 <image> marker"):
        engine.generate(case.prompt("What?", 1), images=[WIDE, TALL], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="image tiles"):  # a split picture's runs sit between text tokens
        engine.generate({"prompt_token_ids": [5, engine.family.image_token_id, 6], "multi_modal_data": {"image": WIDE}},
                        sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="takes no videos"):
        engine.generate({"prompt": case.prompt("What happens?") + "<video>", "multi_modal_data": {"video": Video(
            torch.zeros(2, 32, 32, 3, dtype=torch.uint8).numpy())}}, sampling_params=GREEDY, use_tqdm=False)


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


def _copy_checkpoint(path: Path, target: Path) -> Path:
    shutil.copytree(path, target, ignore=shutil.ignore_patterns("model.safetensors"))
    return target


def test_the_key_layout_loads_strictly(idefics3, tmp_path):
    """transformers 5 and the published checkpoints name tensors `model.text_model.*`, `model.vision_model.*`,
    `model.connector.*` and `lm_head.weight`: a missing tensor, and one the model has no place for, are named."""
    tensors = load_file(str(idefics3.path / "model.safetensors"))
    assert {name.split(".")[1] for name in tensors if name.startswith("model.")} == {"text_model", "vision_model", "connector"}
    missing = _copy_checkpoint(idefics3.path, tmp_path / "missing")
    save_file({n: t for n, t in tensors.items() if "modality_projection" not in n}, str(missing / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(WeightsMismatchError, match="modality_projection"):
        _engine(missing)
    extra = _copy_checkpoint(idefics3.path, tmp_path / "extra")
    save_file({**tensors, "model.connector.extra.weight": torch.zeros(2)}, str(extra / "model.safetensors"), metadata={"format": "pt"})
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
    from mmengine.cli import main

    assert main(["demo", "--family", family, "--requests", "4", "--max-tokens", "2", "--cache-dir", str(tmp_path)]) == 0
    assert f"tiny {family} checkpoint" in capsys.readouterr().out
    path = tiny_smolvlm_path(SPECS[family])
    assert main(["budget", "--model", str(path), "--device", "cpu", "--max-model-len", "1024", "--block-size", "4"]) == 0
    shown = capsys.readouterr().out
    grid, items = {"idefics3": ("3x3", 10), "smolvlm": ("2x2", 5)}[family]
    assert "one item per tile" in shown and f"up to {grid} tiles plus the global image" in shown
    assert f"(a picture is up to {items} items)" in shown


def test_the_encoder_budget_counts_a_pictures_tiles(idefics3):
    """One sequence of one picture may need ten tiles encoded in a step: the budget's cap counts them."""
    engine = _engine(idefics3.path, max_num_seqs=1, limit_mm_per_prompt={"image": 1})
    assert engine.family.max_items_per_image == 10
    assert engine.encoder_budget.items_cap == 10 and engine.encoder_budget.compute_budget_tokens == 10 * 16
    prompt = idefics3.prompt("What is it?", 1)
    assert _greedy(engine, prompt, [SQUARE]) == _greedy(idefics3.engine, prompt, [SQUARE])
