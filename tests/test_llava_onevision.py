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
from conftest import hf_greedy
from family_checks import (GREEDY, TILE_PROBE_SIZES, against_the_processor, check_bad_inputs, check_demo_and_budget,
                           check_every_block_offset, check_hash_follows_a_setting, check_key_layout, check_mixed_batch,
                           check_pictures_across_chunks, check_preemption, check_repeated_prompt, check_token_prompts,
                           check_top_logprobs, engine_fixtures, greedy, nested_tower_name, tiny_engine)

from mmengine.errors import ImageCountMismatchError, UnsupportedModelError, VideoCountMismatchError
from mmengine.models.registry import load_hf_processor
from mmengine.multimodal.video import Video
from mmengine.testing.images import make_test_image
from mmengine.testing.llava_onevision import onevision_prompt, tiny_onevision_path

WIDE, TALL, LARGE = make_test_image(3, (90, 30)), make_test_image(4, (50, 70)), make_test_image(5, (100, 100))
QUESTION = "Describe the picture in detail."

path, engine, uncached = engine_fixtures(tiny_onevision_path)


@pytest.mark.parametrize("pictures", [[], [WIDE], [LARGE], [WIDE, TALL]], ids=["text", "1x3", "3x3-interpolated", "1x3+3x2"])
def test_greedy_tokens_equal_transformers(path, engine, pictures):
    """A 90x30 picture tiles 1x3 (unpadded rows), a 50x70 one 3x2 (unpadded columns), a 100x100 one 3x3,
    whose 12x12 features are interpolated down to 8x8 (anyres_max_4)."""
    grids = [engine.family.anyres.grid(picture.height, picture.width) for picture in pictures]
    assert grids == {0: [], 1: [(1, 3)] if pictures == [WIDE] else [(3, 3)], 2: [(1, 3), (3, 2)]}[len(pictures)]
    prompt = onevision_prompt(QUESTION, len(pictures))
    assert greedy(engine, prompt, pictures or None) == [hf_greedy(path, prompt, pictures, 12, ignore_eos=True)]


def test_expansion_and_pixels_are_transformers(engine):
    """Every picture's run length and tiles equal transformers' processor's for sizes around the tile, the
    pinpoints and odd aspect ratios (PIL image processor: no torchvision)."""
    for width, height, processed, reference in against_the_processor(engine, onevision_prompt("What?", 1), TILE_PROBE_SIZES):
        (item,) = processed.mm_items
        assert torch.equal(item.encoder_inputs["pixel_values"], reference["pixel_values"][0])
        assert item.encoder_inputs["image_size"].tolist() == [height, width]


def test_a_token_prompt_with_adjacent_pictures(engine):
    """The template writes `<image><image>`: the processor's expanded ids hold both pictures' runs as one run
    of placeholders, and one placeholder per picture is also taken; both give the text prompt's tokens."""
    prompt = onevision_prompt("Compare them.", 2)
    expanded = engine.input_processor.hf_processor(text=prompt, images=[WIDE, TALL])["input_ids"][0]
    markers = engine.input_processor.tokenizer(prompt)["input_ids"]
    check_token_prompts(engine, prompt, [WIDE, TALL], [expanded, markers])
    first = list(expanded).index(engine.family.image_token_id)
    short = list(expanded[:first]) + list(expanded[first + 3:])  # a run three placeholders short of the pictures'
    with pytest.raises(ImageCountMismatchError):
        engine.generate({"prompt_token_ids": short, "multi_modal_data": {"image": [WIDE, TALL]}}, sampling_params=GREEDY,
                        use_tqdm=False)


def test_top_logprobs_are_close(path, uncached):
    check_top_logprobs(uncached, path, onevision_prompt(QUESTION, 2), [TALL, LARGE])


def test_pictures_across_chunk_boundaries(path):
    """Chunks of 24 tokens end inside both pictures' runs (causal attention: a chunk may split a picture,
    whose encoder output is computed once and read by each chunk)."""
    items, _ = check_pictures_across_chunks(path, onevision_prompt(QUESTION, 2), [WIDE, TALL], 24)
    assert len(items) == 2


def test_a_mixed_batch_equals_each_prompt_alone(uncached):
    prompts = [onevision_prompt(QUESTION, 0), onevision_prompt("What is it?", 1), onevision_prompt("Compare them.", 2),
               onevision_prompt("And this one?", 1)]
    check_mixed_batch(uncached, prompts, [None, [LARGE], [TALL, WIDE], [TALL]])


def test_a_picture_at_every_offset_from_a_block_boundary(path, uncached):
    prompts = ["a " * pad + onevision_prompt("What is it?", 1) for pad in range(5)]
    assert check_every_block_offset(tiny_engine(path, encoder_cache_size=1), uncached, prompts, [WIDE]) == 1


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(path, engine):
    """One encoder run per picture (all its tiles: one encoder-cache entry), none for the repeat, whose prompt
    is a prefix hit but for its last block."""
    check_repeated_prompt(path, engine, onevision_prompt(QUESTION, 1), [make_test_image(7, (70, 40))])


def test_the_item_is_hashed_on_the_picture_and_the_tiling_settings(engine, path):
    """The mm_hash is the picture's content under the processor's settings, which hold the pinpoints and
    tile size: other tiling settings make another entry."""
    check_hash_follows_a_setting(engine, path, onevision_prompt("What?", 1), WIDE, "image_grid_pinpoints", [[32, 32], [32, 64]],
                                 ['"image_grid_pinpoints"'])


def test_preemption_keeps_the_tokens(path):
    """Two prompts that share no block, each 27 blocks of 4 and 30 once generated, in 56 blocks: both are
    admitted and one is preempted as they grow."""
    check_preemption(path, [text + onevision_prompt(QUESTION, 1) for text in ("One.", "Two!")], [WIDE], 56)


def test_bad_inputs_are_typed_errors(engine):
    check_bad_inputs(engine, onevision_prompt("What?", 1), [WIDE, TALL], count_match="1 <image> marker")
    with pytest.raises(VideoCountMismatchError, match="1 <video> marker"):
        engine.generate(onevision_prompt("What?", 0, num_videos=1), sampling_params=GREEDY, use_tqdm=False)


def test_the_published_key_layout_loads_strictly(path, engine, tmp_path):
    """The hub's files nest the tower under `vision_tower.vision_model.*` (transformers 5 saves it without
    that level); both load to the same tokens, and a missing image_newline is named."""
    check_key_layout(path, engine, tmp_path, nested_tower_name, onevision_prompt("What is it?", 1), [WIDE], "image_newline",
                     "image_newline")


def test_a_default_feature_selection_is_refused(path, tmp_path):
    """transformers cannot pack tiles that dropped their first patch: the checkpoint is refused by name."""
    import json

    changed = shutil.copytree(path, tmp_path / "default")
    config = json.loads((changed / "config.json").read_text())
    config["vision_feature_select_strategy"] = "default"
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="vision_feature_select_strategy 'default'"):
        tiny_engine(changed)


def test_demo_and_budget(path, tmp_path, capsys):
    shown = check_demo_and_budget("llava_onevision", path, tmp_path, capsys)
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
