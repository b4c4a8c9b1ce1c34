"""The checks every multimodal family's end-to-end test module runs on its tiny checkpoint, written once: the
engine with the tests' options, the module's engine fixtures, greedy tokens, and the prefix-hit, divisible-block,
preemption, prefill-chunk, token-prompt, item-hash, key-layout, bad-input, demo and budget checks. A family's
module keeps what is its own: its prompts and pictures, its tensor names and its expected numbers."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from books import assert_books_consistent
from conftest import hf_greedy, hf_logits
from helpers import record_prefill_chunks
from safetensors.torch import load_file, save_file

from mmengine import MMEngine, SamplingParams
from mmengine.core.request import MMItem
from mmengine.encoder_cache.hashing import hash_image, model_fingerprint, processor_settings_key
from mmengine.errors import ImageCountMismatchError, InvalidInputError, WeightsMismatchError
from mmengine.multimodal.video import Video
from mmengine.testing.images import make_test_image

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Picture sizes (width, height) around a 32 px tile, at its pinpoints and at odd aspect ratios
TILE_PROBE_SIZES = [(5, 90), (31, 33), (32, 32), (40, 64), (65, 17), (97, 96), (200, 30), (120, 250)]


def tiny_engine(path: Path, **kwargs: Any) -> MMEngine:
    """An engine on a tiny checkpoint with the tests' options (fp32 on CPU, eager, blocks of 4), `kwargs` over them."""
    options = dict(device="cpu", dtype="float32", max_model_len=512, enforce_eager=True, block_size=4)
    return MMEngine(str(path), **{**options, **kwargs})


def engine_fixtures(tiny_path: Callable[[], Path]) -> tuple[Any, Any, Any]:
    """A family module's fixtures `path` (its tiny checkpoint), `engine` and `uncached` (prefix caching off: every
    request computes its whole prompt), module-scoped; the module binds them to those names."""

    @pytest.fixture(scope="module", name="path")
    def path_fixture() -> Path:
        return tiny_path()

    @pytest.fixture(scope="module", name="engine")
    def engine_fixture(path: Path) -> MMEngine:
        return tiny_engine(path)

    @pytest.fixture(scope="module", name="uncached")
    def uncached_fixture(path: Path) -> MMEngine:
        return tiny_engine(path, enable_prefix_caching=False)

    return path_fixture, engine_fixture, uncached_fixture


def greedy(engine: MMEngine, prompts, images, params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    return [output.token_ids for output in outputs]


def _block_size(engine: MMEngine) -> int:
    return engine.config.cache_config.block_size


def check_top_logprobs(engine: MMEngine, path: Path, prompt: str, pictures: list, pictures_matter: bool = False) -> None:
    """The next token's top-5 tokens equal transformers' and their log-probabilities are within 1e-4; with
    `pictures_matter`, transformers' own log-probabilities differ by more than 1e-2 with the pictures swapped."""
    want = torch.log_softmax(hf_logits(path, prompt, pictures), -1).topk(5)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    top = engine.generate(prompt, images=pictures, sampling_params=params, use_tqdm=False)[0].logprobs[0].top
    assert [token for token, _ in top] == want.indices.tolist()
    assert (torch.tensor([logprob for _, logprob in top]) - want.values).abs().max() < 1e-4
    if pictures_matter:
        swapped = torch.log_softmax(hf_logits(path, prompt, pictures[::-1]), -1)
        assert (swapped - torch.log_softmax(hf_logits(path, prompt, pictures), -1)).abs().max() > 1e-2


def against_the_processor(engine: MMEngine, prompt: str, sizes: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, Any, Any]]:
    """For a picture of each (width, height): checks that the prompt's ids equal transformers' processor's, then
    yields the width, height, our processed prompt and the processor's output (return_tensors="pt")."""
    processor = engine.input_processor
    for index, (width, height) in enumerate(sizes):
        picture = make_test_image(index, (width, height))
        reference = processor.hf_processor(text=prompt, images=[picture], return_tensors="pt")
        processed = processor.process(prompt, [picture], GREEDY)
        assert processed.prompt_token_ids == reference["input_ids"][0].tolist()
        yield width, height, processed, reference


def check_token_prompts(engine: MMEngine, prompt: str, pictures: list, token_prompts: Sequence[Sequence[int]],
                        params: SamplingParams = GREEDY):
    """Each token prompt with the pictures gives the text prompt's prompt ids and tokens; returns the text's output."""
    text = engine.generate(prompt, images=pictures, sampling_params=params, use_tqdm=False)[0]
    for ids in token_prompts:
        tokens = engine.generate({"prompt_token_ids": list(ids), "multi_modal_data": {"image": pictures}},
                                 sampling_params=params, use_tqdm=False)[0]
        assert tokens.prompt_token_ids == text.prompt_token_ids and tokens.token_ids == text.token_ids
    return text


def check_pictures_across_chunks(path: Path, prompt: str, pictures: list, chunk_tokens: int, min_split: int | None = None,
                                 params: SamplingParams = GREEDY, **options: Any) -> tuple[list[MMItem], list[tuple[int, int]]]:
    """Prefill chunks of `chunk_tokens` (the engine's other `options` besides the tests'): the tokens are
    transformers', one encoder run per item, and a chunk ends inside each item's run (`min_split`: inside at least
    that many). Returns the items and the chunks."""
    engine = tiny_engine(path, max_num_batched_tokens=chunk_tokens, **options)
    chunks = record_prefill_chunks(engine)
    assert greedy(engine, prompt, pictures, params) == [hf_greedy(path, prompt, pictures, params.max_tokens, ignore_eos=True)]
    items = engine.input_processor.process(prompt, pictures, params).mm_items
    split = sum(any(item.offset < end < item.end for _, end in chunks) for item in items)
    assert split == len(items) if min_split is None else split >= min_split
    assert engine.stats()["encoder_runs"] == len(items)
    return items, chunks


def check_mixed_batch(engine: MMEngine, prompts: list[str], images: list, params: SamplingParams = GREEDY) -> None:
    """A batch of prompts with and without pictures gives each prompt's tokens alone."""
    batch = greedy(engine, prompts, images, params)
    assert batch == [greedy(engine, prompt, image, params)[0] for prompt, image in zip(prompts, images)]


def check_repeated_prompt(path: Path, engine: MMEngine, prompt: str, pictures: list, params: SamplingParams = GREEDY,
                          items: int = 1) -> None:
    """The first request encodes its `items` once (at most one encoder-cache entry each); the same request again is
    a prefix hit but for its last block and encodes nothing; both give transformers' tokens; no re-encode."""
    block = _block_size(engine)
    before = engine.stats()
    first = greedy(engine, prompt, pictures, params)
    middle = engine.stats()
    again = engine.generate(prompt, images=pictures, sampling_params=params, use_tqdm=False)[0]
    after = engine.stats()
    assert again.token_ids == first[0] == hf_greedy(path, prompt, pictures, params.max_tokens, ignore_eos=True)
    assert middle["encoder_runs"] == before["encoder_runs"] + items and after["encoder_runs"] == middle["encoder_runs"]
    assert middle["encoder_cache_entries"] - before["encoder_cache_entries"] <= items
    prompt_len = len(again.prompt_token_ids)
    assert after["prefix_cache_hits"] - middle["prefix_cache_hits"] >= prompt_len - block
    assert after["prefill_tokens_computed"] - middle["prefill_tokens_computed"] <= block  # at most the last block
    assert again.num_cached_tokens >= prompt_len - block
    assert before["reencodes_after_prefix_hit"] == after["reencodes_after_prefix_hit"] == 0


def check_every_block_offset(cached: MMEngine, reference: MMEngine, prompts: list[str], pictures: list) -> int:
    """The divisible-block matrix (vLLM's #11895), on `cached` at the smallest encoder budget (one item): the
    prompts put the first item at each offset from a block boundary, and some prompts' lengths are whole blocks;
    identical requests twice and once more give `reference`'s tokens (prefix caching off), the last with a prefix
    hit. One encoder run an item of a prompt, no re-encode after a hit; returns that number of items."""
    block = _block_size(cached)
    assert cached.encoder_budget.compute_budget_tokens == cached.family.max_tokens_per_item()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    offsets, lengths = set(), set()
    for prompt in prompts:
        first = cached.generate([prompt] * 2, images=[pictures] * 2, sampling_params=params, use_tqdm=False)
        again = cached.generate(prompt, images=pictures, sampling_params=params, use_tqdm=False)
        alone = reference.generate(prompt, images=pictures, sampling_params=params, use_tqdm=False)[0]
        assert [o.token_ids for o in first + again] == [alone.token_ids] * 3
        assert again[0].num_cached_tokens > 0
        items = cached.input_processor.process(prompt, pictures, params).mm_items
        offsets.add(items[0].offset % block)
        lengths.add(len(alone.prompt_token_ids) % block)
    assert offsets == set(range(block)) and 0 in lengths
    stats = cached.stats()
    assert stats["encoder_runs"] == len(items) and stats["reencodes_after_prefix_hit"] == 0
    return len(items)


def check_preemption(path: Path, prompts: list[str], pictures: list, num_kv_blocks: int, params: SamplingParams = GREEDY,
                     expected: list[list[int]] | None = None, **options: Any) -> None:
    """The prompts, each with the pictures, in `num_kv_blocks` blocks (the engine's other `options` besides the
    tests'): one is preempted, the books stay consistent and the tokens are `expected` (default transformers' for
    each prompt)."""
    tight = tiny_engine(path, num_kv_blocks=num_kv_blocks, max_num_seqs=4, **options)
    outputs = greedy(tight, prompts, [pictures] * len(prompts), params)
    assert tight.scheduler.num_preemptions > 0
    assert_books_consistent(tight)
    if expected is None:
        expected = [hf_greedy(path, prompt, pictures, params.max_tokens, ignore_eos=True) for prompt in prompts]
    assert outputs == expected


def check_hash_follows_a_setting(engine: MMEngine, path: Path, prompt: str, picture, setting: str, other_value: object,
                                 shown: Sequence[str]) -> None:
    """The item's mm_hash is the picture's content under the image processor's settings (which show `shown`);
    with `setting` at `other_value` the hash differs."""
    processor = engine.input_processor
    (item,) = processor.process(prompt, [picture], GREEDY).mm_items
    image_processor = processor.hf_processor.image_processor
    settings = processor_settings_key(image_processor)
    assert item.mm_hash == hash_image(picture.convert("RGB"), model_fingerprint(path), settings)
    assert all(text in settings for text in shown)
    original = getattr(image_processor, setting)
    try:
        setattr(image_processor, setting, other_value)
        assert hash_image(picture.convert("RGB"), model_fingerprint(path), processor_settings_key(image_processor)) != item.mm_hash
    finally:
        setattr(image_processor, setting, original)


def check_bad_inputs(engine: MMEngine, one_picture_prompt: str, two_pictures: list, count_match: str | None = None,
                     video_prompt: str | None = None, embeds_width: int | None = None) -> None:
    """Two pictures for a one-picture prompt are an ImageCountMismatchError (matching `count_match`); with
    `video_prompt`, a video is refused by name; with `embeds_width`, image_embeds of 4 rows that width are an
    InvalidInputError naming image_embeds."""
    with pytest.raises(ImageCountMismatchError, match=count_match):
        engine.generate(one_picture_prompt, images=two_pictures, sampling_params=GREEDY, use_tqdm=False)
    if video_prompt is not None:
        video = Video(torch.zeros(2, 32, 32, 3, dtype=torch.uint8).numpy())
        with pytest.raises(InvalidInputError, match="takes no videos"):
            engine.generate({"prompt": video_prompt, "multi_modal_data": {"video": video}}, sampling_params=GREEDY, use_tqdm=False)
    if embeds_width is not None:
        with pytest.raises(InvalidInputError, match="image_embeds"):
            engine.generate(one_picture_prompt, images=[{"image_embeds": torch.zeros(4, embeds_width)}], sampling_params=GREEDY,
                            use_tqdm=False)


def save_variant(path: Path, target: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of the checkpoint at `path` into `target` with `tensors` as its model.safetensors."""
    shutil.copytree(path, target, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def check_key_layout(path: Path, engine: MMEngine, tmp_path: Path, rename: Callable[[str], str], prompt: str, pictures: list,
                     missing: str, match: str, params: SamplingParams = GREEDY) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors renamed by `rename` load strictly to `engine`'s tokens; without the (renamed) tensor
    `missing` loading is a WeightsMismatchError matching `match`. Returns the checkpoint's tensors."""
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {rename(name): tensor for name, tensor in tensors.items()}
    assert renamed.keys() != tensors.keys()
    other = save_variant(path, tmp_path / "renamed", renamed)
    assert greedy(tiny_engine(other), prompt, pictures, params) == greedy(engine, prompt, pictures, params)
    del renamed[missing]
    with pytest.raises(WeightsMismatchError, match=match):
        tiny_engine(save_variant(path, tmp_path / "missing", renamed))
    return tensors


def transformers5_name(name: str) -> str:
    """A published LLaVA-style checkpoint's tensor name (language_model.model.*, language_model.lm_head.*,
    vision_tower.*, multi_modal_projector.*) in transformers 5's layout (model.language_model.*, lm_head.*,
    model.vision_tower.*, model.multi_modal_projector.*)."""
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


def nested_tower_name(name: str) -> str:
    """A tensor name with the SigLIP tower nested one level down, `vision_tower.vision_model.*`, as the hub's
    files have it (transformers 5 saves `vision_tower.*`)."""
    return "vision_tower.vision_model." + name.removeprefix("vision_tower.") if name.startswith("vision_tower.") else name


def check_both_key_layouts(path: Path, engine: MMEngine, tmp_path: Path, prompt: str, pictures: list, missing: str,
                           match: str) -> None:
    """The published files (language_model.model.*) and transformers 5's layout (transformers5_name) give the same
    tokens; without `missing` (its transformers 5 name) the error matches `match`."""
    tensors = check_key_layout(path, engine, tmp_path, transformers5_name, prompt, pictures, missing, match)
    assert any(name.startswith("language_model.model.") for name in tensors)


def check_demo_and_budget(family: str, path: Path, tmp_path: Path, capsys, max_model_len: int = 512) -> str:
    """`mmengine demo --family` runs the family's tiny checkpoint; `mmengine budget` on `path` succeeds. Returns
    what the budget printed (each family checks its own numbers there)."""
    from mmengine.cli import main

    assert main(["demo", "--family", family, "--requests", "4", "--max-tokens", "2", "--cache-dir", str(tmp_path)]) == 0
    assert f"tiny {family} checkpoint" in capsys.readouterr().out
    assert main(["budget", "--model", str(path), "--device", "cpu", "--max-model-len", str(max_model_len), "--block-size", "4"]) == 0
    return capsys.readouterr().out
