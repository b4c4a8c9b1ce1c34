"""Videos for the Qwen families: preprocessing against the image path frame by frame, greedy tokens
against transformers' own model classes (given the pixel_values_videos, video_grid_thw,
second_per_grid_ts and mm_token_type_ids its processor would give), timestamps, and the encoder
cache's books (one run per temporal patch, shared by every question about a clip)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import CPU_FP32, _hf_model
from mmengine import MMEngine, SamplingParams
from mmengine.models import qwen_video
from mmengine.multimodal.video import Video
from mmengine.testing.video import hf_video_inputs, make_test_clip

QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def chat(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


clip = make_test_clip


@pytest.fixture(scope="module")
def engines(family_checkpoint):
    made: dict[str, MMEngine] = {}

    def get(name: str) -> MMEngine:
        if name not in made:
            made[name] = MMEngine(str(family_checkpoint(name)), dtype="float32", device="cpu",
                                  limit_mm_per_prompt={"image": 2, "video": 2})
        return made[name]

    return get


def hf_video_greedy(
    engine: MMEngine, path, prompt: str, images: list, videos: list, max_new_tokens: int, sampled_fps: float = 2.0
) -> list[int]:
    """transformers' generate on the prompt mmengine made (its ids and its videos' pixel values): what
    transformers' processor gives for these frames and this text. `sampled_fps`: the rate of the kept
    frames, from which transformers' processor derives second_per_grid_ts (Qwen2.5-VL)."""
    model, _ = _hf_model(path, CPU_FP32)
    inputs = hf_video_inputs(engine.input_processor, prompt, images, videos, sampled_fps)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def ours(engine: MMEngine, prompt: str, images: list, videos: list) -> list[int]:
    return list(engine.generate(prompt, images=images or None, videos=videos, sampling_params=GREEDY, use_tqdm=False)[0].token_ids)


@pytest.mark.parametrize("name", QWEN)
def test_video_frames_patch_like_the_image_path(engines, name):
    """A video of temporal_patch_size copies of a frame is the image processor's input for that frame."""
    engine = engines(name)
    family = engine.family
    frame = clip(1, 70, 100)[0]
    pictures = engine.input_processor.hf_processor.image_processor(images=[Image.fromarray(frame)], return_tensors="pt")
    height, width = family.resized_size(70, 100)
    settings = family.video
    same_normalization = qwen_video.QwenVideoSettings(**{
        **settings.__dict__, "image_mean": tuple(engine.input_processor.hf_processor.image_processor.image_mean),
        "image_std": tuple(engine.input_processor.hf_processor.image_processor.image_std),
    })
    (item,) = qwen_video.patch_items(same_normalization, np.stack([frame] * settings.temporal_patch_size), height, width)
    assert torch.equal(item["image_grid_thw"], pictures["image_grid_thw"])
    torch.testing.assert_close(item["pixel_values"], pictures["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", QWEN)
@pytest.mark.parametrize(
    "case",
    ["video", "video+image", "fps1", "fps2"],
)
def test_video_greedy_tokens_equal_transformers(engines, family_checkpoint, name, case):
    engine = engines(name)
    images: list = []
    sampled_fps = 2.0  # frames given without sampling: taken at the default frame rate, 2 frames/s
    if case == "video":
        videos, prompt = [clip(6)], chat(VIDEO + "What happens?")
    elif case == "video+image":
        images = [Image.fromarray(clip(1, 50, 70, seed=3)[0])]
        videos, prompt = [clip(4, seed=1)], chat(IMAGE + "and then" + VIDEO + "Compare them.")
    else:  # the same 16 frames at 4 frames/s, sampled at 1 or 2 frames/s: other frames, times and positions
        fps = 1.0 if case == "fps1" else 2.0
        videos, prompt = [Video(clip(16, seed=2), fps=fps, frame_rate=4.0)], chat(VIDEO + "Describe.")
        sampled_fps = len(SAMPLED[name, fps]) / 16 * 4.0
    expected = hf_video_greedy(engine, family_checkpoint(name), prompt, images, videos, GREEDY.max_tokens, sampled_fps)
    assert ours(engine, prompt, images, videos) == expected


# 16 frames at 4 frames/s sampled at 1 and 2 frames/s, by transformers' rules: Qwen2-VL's sample_frames
# (arange over the clip, a multiple of temporal_patch_size frames) and Qwen3-VL's (linspace, rounded)
SAMPLED = {
    ("qwen2_vl", 1.0): [0, 4, 8, 12], ("qwen2_vl", 2.0): [0, 2, 4, 6, 8, 10, 12, 14],
    ("qwen2_5_vl", 1.0): [0, 4, 8, 12], ("qwen2_5_vl", 2.0): [0, 2, 4, 6, 8, 10, 12, 14],
    ("qwen3_vl", 1.0): [0, 5, 10, 15], ("qwen3_vl", 2.0): [0, 2, 4, 6, 9, 11, 13, 15],
    ("qwen3_5", 1.0): [0, 5, 10, 15], ("qwen3_5", 2.0): [0, 2, 4, 6, 9, 11, 13, 15],  # Qwen3-VL's video processor
}


@pytest.mark.parametrize("name", QWEN)
@pytest.mark.parametrize("fps", [1.0, 2.0])
def test_frame_sampling_follows_transformers(engines, name, fps):
    from mmengine.multimodal.video import VideoInfo

    plan = engines(name).family.plan_video(VideoInfo(16, 4.0, 60, 84), Video(None, fps=fps))
    assert list(plan.indices) == SAMPLED[name, fps]
    if name in ("qwen3_vl", "qwen3_5"):  # its video processor runs without torchvision: ask it too
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
        from transformers.video_utils import VideoMetadata

        theirs = Qwen3VLVideoProcessor(min_frames=4).sample_frames(VideoMetadata(total_num_frames=16, fps=4.0), fps=fps)
        assert list(plan.indices) == theirs.tolist()


def test_qwen2_5_positions_follow_the_frame_rate(engines):
    """Qwen2.5-VL spaces a video's patches by tokens_per_second x seconds per patch: a clip sampled at
    1 frame/s sits twice as far apart in time as at 2 frames/s."""
    engine = engines("qwen2_5_vl")
    tables = {}
    for fps in (1.0, 2.0):
        processed = engine.input_processor.process(chat(VIDEO + "x"), None, GREEDY, videos=[Video(clip(16), fps=fps, frame_rate=4.0)])
        first = [item for item in processed.mm_items if item.video_patch.index in (0, 1)]
        rows = processed.mrope_positions.table
        tables[fps] = rows[first[1].offset, 0] - rows[first[0].offset, 0]
    assert tables[1.0] == 2 * tables[2.0] > 0


def test_qwen3_writes_each_patch_timestamp_into_the_prompt(engines):
    engine = engines("qwen3_vl")
    # 8 frames at 4 frames/s kept as given: patches of 2 frames at 0.125 s, 0.625 s, 1.125 s, 1.625 s
    processed = engine.input_processor.process(chat(VIDEO + "x"), None, GREEDY, videos=[Video(clip(8), frame_rate=4.0)])
    text = engine.tokenizer.decode(processed.prompt_token_ids)
    assert [f"<{t} seconds>" in text for t in ("0.1", "0.6", "1.1", "1.6")] == [True] * 4
    assert text.count("<|vision_start|>") == 4 and len(processed.mm_items) == 4


@pytest.mark.parametrize("name", QWEN)
def test_ten_questions_about_one_clip_encode_it_once(engines, family_checkpoint, name):
    engine = MMEngine(str(family_checkpoint(name)), dtype="float32", device="cpu", num_kv_blocks=48, block_size=4)
    frames = clip(8)
    prompts = [chat(VIDEO + f"Question {k}: what is in frame {k}?") for k in range(10)]
    texts = [chat(f"Unrelated question number {k} about nothing much at all.") for k in range(6)]
    mixed = prompts + texts
    order = np.random.default_rng(0).permutation(len(mixed))
    videos = [[frames] if i < 10 else None for i in order]
    engine.generate([mixed[i] for i in order], videos=videos, sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
    stats = engine.stats()
    patches = len(engine.input_processor.process(prompts[0], None, GREEDY, videos=[frames]).mm_items)
    assert stats["kv_blocks_evicted"] > 0  # the KV cache is tight: the clip's blocks came and went
    assert stats["encoder_runs"] == patches  # one run per temporal patch for all ten questions
    assert stats["reencodes_after_prefix_hit"] == 0
    assert stats["videos_preprocessed"] == 1
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["encoder_cache_referenced"] == 0


def _prompt_with_video_placed(engine: MMEngine, frames, block_size: int, placement: str) -> str:
    """A one-video prompt whose length is a multiple of block_size, its last item ending in the last
    full block (the recomputed one) or at the prompt's last token."""
    for pad in range(0, 60):
        for tail in ["", " x", " what", " what is it"]:
            prompt = "x" + " a" * pad + VIDEO + tail
            processed = engine.input_processor.process(prompt, None, GREEDY, videos=[frames])
            n, last = len(processed.prompt_token_ids), processed.mm_items[-1]
            if n % block_size or n < 2 * block_size:
                continue
            if placement == "ends_in_last_full_block" and n - block_size < last.end < n - 1:
                return prompt
            if placement == "ends_at_prompt_end" and last.end >= n - 1:
                return prompt
    raise AssertionError(f"no prompt for placement={placement}")


@pytest.mark.parametrize("name", QWEN)
@pytest.mark.parametrize("placement", ["ends_in_last_full_block", "ends_at_prompt_end"])
def test_identical_requests_with_a_video_in_the_recomputed_block(family_checkpoint, name, placement):
    """The divisible-block matrix with a video: the clip needs more embeddings than one step's encoder
    budget, so it is encoded in parts across steps; the outputs equal prefix caching off, each part is
    encoded once, and a later request is a full hit."""
    kwargs = dict(max_model_len=512, block_size=4, encoder_cache_size=1, dtype="float32", device="cpu")
    cached = MMEngine(str(family_checkpoint(name)), **kwargs)
    plain = MMEngine(str(family_checkpoint(name)), enable_prefix_caching=False, **kwargs)
    frames = Video(clip(48), total_pixels=32 * 32 * 400)  # Qwen3-VL's bound is over the whole clip
    prompt = _prompt_with_video_placed(cached, frames, 4, placement)
    items = cached.input_processor.process(prompt, None, GREEDY, videos=[frames]).mm_items
    assert sum(item.length for item in items) > cached.encoder_budget.compute_budget_tokens  # parts across steps
    outputs = cached.generate([prompt] * 3, videos=[[frames]] * 3, sampling_params=GREEDY, use_tqdm=False)
    again = cached.generate(prompt, videos=[frames], sampling_params=GREEDY, use_tqdm=False)
    reference = plain.generate([prompt] * 3, videos=[[frames]] * 3, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference] == [again[0].token_ids] * 3
    stats = cached.stats()
    assert stats["encoder_runs"] == len(items) and stats["reencodes_after_prefix_hit"] == 0
    assert again[0].num_cached_tokens > 0


@pytest.mark.parametrize("name", QWEN)
def test_chunked_prefill_and_preemption_across_a_video_keep_the_tokens(engines, family_checkpoint, name):
    """Prompts prefilled 8 tokens a step (the chunks cut through the video's items), and requests
    preempted for want of KV blocks (without prefix grouping, whose admission gate avoids them), give the
    tokens the default engine gives (which equal transformers')."""
    videos = [clip(8)]
    prompts = [chat(VIDEO + f"What happens in part {k}?") for k in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [list(o.token_ids) for o in engines(name).generate(prompts, videos=[videos] * 3, sampling_params=params, use_tqdm=False)]
    longest = max(len(engines(name).input_processor.process(p, None, params, videos=videos).prompt_token_ids) for p in prompts)
    blocks = -(-(longest + 40) // 4) + 4  # one request fits with room to spare, two do not
    chunked = MMEngine(str(family_checkpoint(name)), dtype="float32", device="cpu", max_num_batched_tokens=8, max_num_seqs=4,
                       block_size=4, num_kv_blocks=blocks, enable_prefix_grouping=False)
    outs = chunked.generate(prompts, videos=[videos] * 3, sampling_params=params, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == expected
    stats = chunked.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.skipif(
    not __import__("transformers").utils.is_torchvision_available(),
    reason="transformers' Qwen video processors need torchvision; without it test_video_frames_patch_like_the_image_path "
    "and test_frame_sampling_follows_transformers check the same rules on the PIL path",
)
@pytest.mark.parametrize("name", QWEN)
def test_preprocessing_matches_transformers_video_processor(engines, family_checkpoint, name):
    """Where transformers can run its video processor: the same frames kept, the same grid, and pixels
    that differ only by the resize filter (torchvision's bicubic against PIL's)."""
    from transformers import AutoVideoProcessor
    from transformers.video_utils import VideoMetadata

    processor = AutoVideoProcessor.from_pretrained(str(family_checkpoint(name)))
    frames = clip(16, 60, 84, seed=4)
    theirs = processor(videos=[frames], video_metadata=[VideoMetadata(total_num_frames=16, fps=4.0)], do_sample_frames=True,
                       fps=2, return_tensors="pt", **({} if name == "qwen3_vl" else {"cap_pixels_per_frame": False}))
    processed = engines(name).input_processor.process(chat(VIDEO + "x"), None, GREEDY, videos=[Video(frames, fps=2.0, frame_rate=4.0)])
    items = processed.mm_items
    grid = [items[0].video_patch.count, *items[0].encoder_inputs["image_grid_thw"].view(3).tolist()[1:]]
    assert theirs["video_grid_thw"].tolist() == [grid]
    ours = torch.cat([item.encoder_inputs["pixel_values"] for item in items])
    assert (ours - theirs["pixel_values_videos"]).abs().mean() < 0.05
