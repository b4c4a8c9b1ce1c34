"""LLaVA-OneVision end to end against transformers (fp32, CPU): the tiny checkpoint tiles pictures into 32 px
tiles of 4x4 patches on grids up to 3x3 under anyres_max_4, over a Qwen2 decoder. Greedy tokens equal
transformers' generate for text, one picture (three tilings, one whose features are interpolated down)
and two pictures of different tilings; a picture across prefill-chunk boundaries, a mixed batch, prefix
hits with one encoder run per picture, preemption; the processor's expansion and pixels are
transformers'; the published key layout loads, strictly. Videos (transformers' video processor needs
torchvision: the family's own frame rules) give transformers' tokens from the pixels its PIL image processor's
resize, rescale and normalize make, one item per frame and the newline on the last."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from books import assert_books_consistent
from conftest import hf_greedy, hf_logits
from helpers import record_prefill_chunks
from safetensors.torch import load_file, save_file

from mmengine import MMEngine, SamplingParams
from mmengine.encoder_cache.hashing import hash_image, model_fingerprint, processor_settings_key
from mmengine.errors import ImageCountMismatchError, UnsupportedModelError, VideoCountMismatchError, WeightsMismatchError
from mmengine.models.registry import load_hf_processor
from mmengine.multimodal.video import Video
from mmengine.testing.images import make_test_image
from mmengine.testing.llava_onevision import onevision_prompt, tiny_onevision_path

WIDE, TALL, LARGE = make_test_image(3, (90, 30)), make_test_image(4, (50, 70)), make_test_image(5, (100, 100))
QUESTION = "Describe the picture in detail."
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return tiny_onevision_path()


def _engine(path, **kwargs) -> MMEngine:
    options = dict(device="cpu", dtype="float32", max_model_len=512, enforce_eager=True, block_size=4)
    return MMEngine(str(path), **{**options, **kwargs})


@pytest.fixture(scope="module")
def engine(path) -> MMEngine:
    return _engine(path)


@pytest.fixture(scope="module")
def uncached(path) -> MMEngine:
    """Without prefix caching: every request computes its whole prompt."""
    return _engine(path, enable_prefix_caching=False)


def _greedy(engine: MMEngine, prompts, images, params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    return [output.token_ids for output in outputs]


@pytest.mark.parametrize("pictures", [[], [WIDE], [LARGE], [WIDE, TALL]], ids=["text", "1x3", "3x3-interpolated", "1x3+3x2"])
def test_greedy_tokens_equal_transformers(path, engine, pictures):
    """A 90x30 picture tiles 1x3 (unpadded rows), a 50x70 one 3x2 (unpadded columns), a 100x100 one 3x3,
    whose 12x12 features are interpolated down to 8x8 (anyres_max_4)."""
    grids = [engine.family.anyres.grid(picture.height, picture.width) for picture in pictures]
    assert grids == {0: [], 1: [(1, 3)] if pictures == [WIDE] else [(3, 3)], 2: [(1, 3), (3, 2)]}[len(pictures)]
    prompt = onevision_prompt(QUESTION, len(pictures))
    assert _greedy(engine, prompt, pictures or None) == [hf_greedy(path, prompt, pictures, 12, ignore_eos=True)]


def test_expansion_and_pixels_are_transformers(engine):
    """Every picture's run length and tiles equal transformers' processor's for sizes around the tile, the
    pinpoints and odd aspect ratios (PIL image processor: no torchvision)."""
    processor = engine.input_processor
    for index, (width, height) in enumerate([(5, 90), (31, 33), (32, 32), (40, 64), (65, 17), (97, 96), (200, 30), (120, 250)]):
        picture = make_test_image(index, (width, height))
        prompt = onevision_prompt("What?", 1)
        reference = processor.hf_processor(text=prompt, images=[picture], return_tensors="pt")
        processed = processor.process(prompt, [picture], GREEDY)
        assert processed.prompt_token_ids == reference["input_ids"][0].tolist()
        (item,) = processed.mm_items
        assert torch.equal(item.encoder_inputs["pixel_values"], reference["pixel_values"][0])
        assert item.encoder_inputs["image_size"].tolist() == [height, width]


def test_a_token_prompt_with_adjacent_pictures(engine):
    """The template writes `<image><image>`: the processor's expanded ids hold both pictures' runs as one run
    of placeholders, and one placeholder per picture is also taken; both give the text prompt's tokens."""
    prompt = onevision_prompt("Compare them.", 2)
    text = engine.generate(prompt, images=[WIDE, TALL], sampling_params=GREEDY, use_tqdm=False)[0]
    expanded = engine.input_processor.hf_processor(text=prompt, images=[WIDE, TALL])["input_ids"][0]
    markers = engine.input_processor.tokenizer(prompt)["input_ids"]
    for ids in (expanded, markers):
        tokens = engine.generate({"prompt_token_ids": list(ids), "multi_modal_data": {"image": [WIDE, TALL]}},
                                 sampling_params=GREEDY, use_tqdm=False)[0]
        assert tokens.prompt_token_ids == text.prompt_token_ids and tokens.token_ids == text.token_ids
    first = list(expanded).index(engine.family.image_token_id)
    short = list(expanded[:first]) + list(expanded[first + 3:])  # a run three placeholders short of the pictures'
    with pytest.raises(ImageCountMismatchError):
        engine.generate({"prompt_token_ids": short, "multi_modal_data": {"image": [WIDE, TALL]}}, sampling_params=GREEDY,
                        use_tqdm=False)


def test_top_logprobs_are_close(path, uncached):
    prompt = onevision_prompt(QUESTION, 2)
    want = torch.log_softmax(hf_logits(path, prompt, [TALL, LARGE]), -1).topk(5)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    top = uncached.generate(prompt, images=[TALL, LARGE], sampling_params=params, use_tqdm=False)[0].logprobs[0].top
    assert [token for token, _ in top] == want.indices.tolist()
    assert (torch.tensor([logprob for _, logprob in top]) - want.values).abs().max() < 1e-4


def test_pictures_across_chunk_boundaries(path):
    """Chunks of 24 tokens end inside both pictures' runs (causal attention: a chunk may split a picture,
    whose encoder output is computed once and read by each chunk)."""
    prompt = onevision_prompt(QUESTION, 2)
    engine = _engine(path, max_num_batched_tokens=24)
    chunks = record_prefill_chunks(engine)
    assert _greedy(engine, prompt, [WIDE, TALL]) == [hf_greedy(path, prompt, [WIDE, TALL], 12, ignore_eos=True)]
    items = engine.input_processor.process(prompt, [WIDE, TALL], GREEDY).mm_items
    for item in items:
        assert any(item.offset < end < item.end for _, end in chunks)  # a chunk ended inside the picture
    assert engine.stats()["encoder_runs"] == 2


def test_a_mixed_batch_equals_each_prompt_alone(uncached):
    prompts = [onevision_prompt(QUESTION, 0), onevision_prompt("What is it?", 1), onevision_prompt("Compare them.", 2),
               onevision_prompt("And this one?", 1)]
    images = [None, [LARGE], [TALL, WIDE], [TALL]]
    batch = _greedy(uncached, prompts, images)
    assert batch == [_greedy(uncached, prompt, image)[0] for prompt, image in zip(prompts, images)]


def test_a_picture_at_every_offset_from_a_block_boundary(path, uncached):
    """The divisible-block matrix (vLLM's #11895): the picture starts at each offset from a block boundary,
    prompts whose length the block size divides included, at the smallest encoder budget (one picture);
    identical requests twice and once more equal prefix caching off. One encoder run, no re-encode after a
    prefix hit."""
    cached = _engine(path, encoder_cache_size=1)
    assert cached.encoder_budget.compute_budget_tokens == cached.family.max_tokens_per_item()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    offsets, lengths = set(), set()
    for pad in range(5):
        prompt = "a " * pad + onevision_prompt("What is it?", 1)
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


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(path, engine):
    """One encoder run per picture (all its tiles: one encoder-cache entry), none for the repeat, whose prompt
    is a prefix hit but for its last block."""
    prompt = onevision_prompt(QUESTION, 1)
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
    assert after["prefill_tokens_computed"] - middle["prefill_tokens_computed"] <= 4  # at most the last block
    assert again.num_cached_tokens >= prompt_len - 4


def test_the_item_is_hashed_on_the_picture_and_the_tiling_settings(engine, path):
    """The mm_hash is the picture's content under the processor's settings, which hold the pinpoints and
    tile size: other tiling settings make another entry."""
    processor = engine.input_processor
    (item,) = processor.process(onevision_prompt("What?", 1), [WIDE], GREEDY).mm_items
    image_processor = processor.hf_processor.image_processor
    settings = processor_settings_key(image_processor)
    assert item.mm_hash == hash_image(WIDE.convert("RGB"), model_fingerprint(path), settings)
    assert '"image_grid_pinpoints"' in settings
    original = image_processor.image_grid_pinpoints
    try:
        image_processor.image_grid_pinpoints = [[32, 32], [32, 64]]
        assert hash_image(WIDE.convert("RGB"), model_fingerprint(path), processor_settings_key(image_processor)) != item.mm_hash
    finally:
        image_processor.image_grid_pinpoints = original


def test_preemption_keeps_the_tokens(path):
    """Two prompts that share no block, each 27 blocks of 4 and 30 once generated, in 56 blocks: both are
    admitted and one is preempted as they grow."""
    prompts = [text + onevision_prompt(QUESTION, 1) for text in ("One.", "Two!")]
    tight = _engine(path, num_kv_blocks=56, max_num_seqs=4)
    outputs = _greedy(tight, prompts, [[WIDE]] * 2)
    assert tight.scheduler.num_preemptions > 0
    assert_books_consistent(tight)
    assert outputs == [hf_greedy(path, prompt, [WIDE], 12, ignore_eos=True) for prompt in prompts]


def test_bad_inputs_are_typed_errors(engine):
    with pytest.raises(ImageCountMismatchError, match="1 <image> marker"):
        engine.generate(onevision_prompt("What?", 1), images=[WIDE, TALL], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(VideoCountMismatchError, match="1 <video> marker"):
        engine.generate(onevision_prompt("What?", 0, num_videos=1), sampling_params=GREEDY, use_tqdm=False)


def _copy_checkpoint(path, target):
    shutil.copytree(path, target, ignore=shutil.ignore_patterns("model.safetensors"))
    return target


def test_the_published_key_layout_loads_strictly(path, engine, tmp_path):
    """The hub's files nest the tower under `vision_tower.vision_model.*` (transformers 5 saves it without
    that level); both load to the same tokens, and a missing image_newline is named."""
    tensors = load_file(str(path / "model.safetensors"))
    published = {("vision_tower.vision_model." + name.removeprefix("vision_tower.") if name.startswith("vision_tower.") else name): tensor
                 for name, tensor in tensors.items()}
    hub = _copy_checkpoint(path, tmp_path / "hub")
    save_file(published, str(hub / "model.safetensors"), metadata={"format": "pt"})
    prompt = onevision_prompt("What is it?", 1)
    assert _greedy(_engine(hub), prompt, [WIDE]) == _greedy(engine, prompt, [WIDE])
    missing = _copy_checkpoint(path, tmp_path / "missing")
    del published["image_newline"]
    save_file(published, str(missing / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsMismatchError, match="image_newline"):
        _engine(missing)


def test_a_default_feature_selection_is_refused(path, tmp_path):
    """transformers cannot pack tiles that dropped their first patch: the checkpoint is refused by name."""
    import json

    changed = shutil.copytree(path, tmp_path / "default")
    config = json.loads((changed / "config.json").read_text())
    config["vision_feature_select_strategy"] = "default"
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="vision_feature_select_strategy 'default'"):
        _engine(changed)


def test_demo_and_budget(path, tmp_path, capsys):
    from mmengine.cli import main

    assert main(["demo", "--family", "llava_onevision", "--requests", "4", "--max-tokens", "2", "--cache-dir", str(tmp_path)]) == 0
    assert "tiny llava_onevision checkpoint" in capsys.readouterr().out
    assert main(["budget", "--model", str(path), "--device", "cpu", "--max-model-len", "512", "--block-size", "4"]) == 0
    shown = capsys.readouterr().out
    assert "up to 96x96 px, 9 tiles" in shown and "anyres_max_4" in shown and "at most 100" in shown


# -- videos ---------------------------------------------------------------------------------------------

FRAMES = np.stack([np.asarray(make_test_image(10 + k, (48, 36))) for k in range(5)])


def _hf_frame_pixels(processor, settings, frames: np.ndarray) -> torch.Tensor:
    """The frames as transformers' PIL image processor's own resize, rescale and normalize make them, at the
    video processor's settings: [1, frames, 3, S, S]."""
    from transformers.image_utils import SizeDict

    ops, pixels = processor.image_processor, []
    for frame in frames:
        resized = ops.resize(frame.transpose(2, 0, 1), SizeDict(height=settings.height, width=settings.width), resample=3)
        pixels.append(ops.normalize(ops.rescale(resized, settings.rescale_factor), list(settings.image_mean), list(settings.image_std)))
    return torch.tensor(np.stack(pixels))[None]


def _hf_video_greedy(path, engine, prompt: str, frames: np.ndarray, pictures: list) -> list[int]:
    """transformers' generate on the prompt with each marker expanded by its processor's counts (its
    _get_num_multimodal_tokens), the pictures' pixels from its image processor, the frames' from _hf_frame_pixels."""
    from transformers import LlavaOnevisionForConditionalGeneration

    model = LlavaOnevisionForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    processor = load_hf_processor(path)
    side = engine.family.video.height
    counts = processor._get_num_multimodal_tokens(image_sizes=[(p.height, p.width) for p in pictures],
                                                  video_sizes=[(len(frames), side, side)])
    text = prompt.replace("<video>", "<video>" * counts["num_video_tokens"][0])
    for count in counts["num_image_tokens"]:
        text = text.replace("<image>", "<IMAGE>" * count, 1)
    inputs = dict(processor.tokenizer(text.replace("<IMAGE>", "<image>"), return_tensors="pt"))
    if pictures:
        inputs.update(processor.image_processor(pictures, return_tensors="pt"))
    with torch.inference_mode():
        out = model.generate(**inputs, pixel_values_videos=_hf_frame_pixels(processor, engine.family.video, frames),
                             do_sample=False, max_new_tokens=12, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("pictures", [[], [TALL]], ids=["video", "picture+video"])
def test_a_video_gives_transformers_tokens(path, engine, pictures):
    """Five 48x36 frames: one item of 2x2 pooled features per frame, the last with the newline (21 tokens)."""
    prompt = onevision_prompt("What happens?", len(pictures), num_videos=1)
    processed = engine.input_processor.process(prompt, pictures, GREEDY, videos=[Video(FRAMES)])
    videos = [item for item in processed.mm_items if item.modality == "video"]
    assert [item.length for item in videos] == [4, 4, 4, 4, 5] and len({item.mm_hash for item in videos}) == 5
    ours = torch.cat([item.encoder_inputs["pixel_values_videos"] for item in videos])
    reference = _hf_frame_pixels(load_hf_processor(path), engine.family.video, FRAMES)[0]
    assert (ours - reference).abs().max() < 1e-6
    outputs = engine.generate({"prompt": prompt, "multi_modal_data": {"image": pictures, "video": Video(FRAMES)}},
                              sampling_params=GREEDY, use_tqdm=False)
    assert outputs[0].token_ids == _hf_video_greedy(path, engine, prompt, FRAMES, pictures)


def test_frames_are_sampled_as_transformers_samples_them(engine):
    """A request's num_frames or fps keeps transformers' default_sample_indices_fn frames; given frames
    without either are all kept (the processor's do_sample_frames=False). One item per kept frame."""
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    frames = np.concatenate([FRAMES, FRAMES[::-1]])  # 10 frames
    metadata = VideoMetadata(total_num_frames=10, fps=4.0)
    for video, expected in [(Video(frames, num_frames=3), default_sample_indices_fn(metadata, num_frames=3)),
                            (Video(frames, fps=1.0, frame_rate=4.0), default_sample_indices_fn(metadata, fps=1.0)),
                            (Video(frames), range(10))]:
        loaded = engine.input_processor.videos.load(video, 0)
        assert list(loaded.plan.indices) == list(expected) and len(loaded.inputs) == len(expected)


def test_a_repeated_video_is_encoded_once(engine):
    """Each frame is an encoder-cache entry: asking again about the clip runs the encoder for none of them."""
    clip = Video(FRAMES[::-1].copy())
    prompts = [onevision_prompt(question, 0, num_videos=1) for question in ("What happens?", "What moves first?")]
    before = engine.stats()["encoder_runs"]
    engine.generate({"prompt": prompts[0], "multi_modal_data": {"video": clip}}, sampling_params=GREEDY, use_tqdm=False)
    middle = engine.stats()["encoder_runs"]
    engine.generate({"prompt": prompts[1], "multi_modal_data": {"video": clip}}, sampling_params=GREEDY, use_tqdm=False)
    assert middle - before == 5 and engine.stats()["encoder_runs"] == middle
