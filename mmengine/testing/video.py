"""Video helpers for tests and benchmarks: a synthetic clip, and transformers' model inputs for a prompt
with videos (what its processor gives, which needs torchvision here, built from mmengine's own
preprocessing instead: the ids, pixel_values_videos, video_grid_thw, second_per_grid_ts and
mm_token_type_ids its Qwen-VL model classes take)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def make_test_clip(num_frames: int, height: int = 60, width: int = 84, seed: int = 0) -> np.ndarray:
    """Frames [T, H, W, 3] uint8 of a moving gradient with noise: neighbouring frames differ, as in a clip."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    frames = [
        np.stack([(xs * 3 + t * 20) % 256, (ys * 4 + t * 35) % 256, ((xs + ys) * 2 + t * 50) % 256], axis=-1)
        for t in range(num_frames)
    ]
    noise = rng.integers(0, 40, (num_frames, height, width, 3))
    return ((np.stack(frames) + noise) % 256).astype(np.uint8)


def hf_video_inputs(processor: Any, prompt: str, images: list, videos: list, sampled_fps: float = 2.0) -> dict[str, torch.Tensor]:
    """transformers' Qwen-VL inputs for a prompt as `processor` (an MMEngine's input_processor)
    processes it. `sampled_fps`: the rate of the kept frames, from which transformers' processor derives
    Qwen2.5-VL's second_per_grid_ts (temporal_patch_size / fps)."""
    from mmengine.sample.params import SamplingParams

    processed = processor.process(prompt, images, SamplingParams(max_tokens=1), videos=videos)
    ids = torch.tensor([processed.prompt_token_ids])
    family = processor.family
    types = torch.zeros_like(ids)
    types[ids == family.image_token_id] = 1
    types[ids == family.video_token_id] = 2
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}
    video_items = [item for item in processed.mm_items if item.modality == "video"]
    if video_items:
        inputs["pixel_values_videos"] = torch.cat([item.encoder_inputs["pixel_values"] for item in video_items])
        grids = []
        for item in video_items:
            if item.video_patch.index == 0:  # a video's grid: its patches' (1, h, w) with t = their count
                grids.append([item.video_patch.count, *item.encoder_inputs["image_grid_thw"].view(3).tolist()[1:]])
        inputs["video_grid_thw"] = torch.tensor(grids)
        if family.model_type == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor([family.video.temporal_patch_size / sampled_fps] * len(grids))
    if images:
        pictures = processor.hf_processor.image_processor(images=images, return_tensors="pt")
        inputs |= {"pixel_values": pictures["pixel_values"], "image_grid_thw": pictures["image_grid_thw"]}
    return inputs
