"""transformers' own Qwen2-VL / Qwen2.5-VL greedy output and logits (the correctness anchor for the Qwen
families), on a pinned device and dtype; the counterpart of conftest.hf_greedy / hf_logits for LLaVA."""

from __future__ import annotations

import functools
from pathlib import Path

import PIL.Image
import torch
from transformers import AutoModelForImageTextToText

from conftest import CPU_FP32, Precision, _on_white
from mmengine.testing import load_qwen_vl_processor


@functools.cache
def _hf_qwen_vl(path: Path, precision: Precision) -> tuple[torch.nn.Module, object]:
    """The checkpoint's own class (Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration)
    and processor, once per (path, precision)."""
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=precision.dtype).to(precision.device).eval()
    return model, load_qwen_vl_processor(path)


def _inputs(processor: object, prompt: str, images: list | None, precision: Precision) -> dict[str, torch.Tensor]:
    images = [_on_white(image) for image in images or ()]
    inputs = processor(text=prompt, images=images or None, return_tensors="pt").to(precision.device)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(precision.dtype)
    return inputs


def hf_qwen_vl_greedy(
    path: Path,
    prompt: str,
    images: list[PIL.Image.Image] | None,
    max_new_tokens: int,
    precision: Precision = CPU_FP32,
    ignore_eos: bool = False,
) -> list[int]:
    """Greedy tokens from transformers' generate for one prompt (its <|image_pad|> markers expanded by the
    processor, images in order). It stops after an eos token (<|im_end|> or <|endoftext|>), which is
    included; `ignore_eos` generates past it, like SamplingParams(ignore_eos=True)."""
    model, processor = _hf_qwen_vl(Path(path), precision)
    inputs = _inputs(processor, prompt, images, precision)
    eos = {"eos_token_id": None} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **eos)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def hf_qwen_vl_generate(
    path: Path,
    prompts: list[str],
    images: list[list[PIL.Image.Image]] | None,
    max_new_tokens: int,
    precision: Precision = CPU_FP32,
    ignore_eos: bool = False,
) -> list[list[int]]:
    """hf_qwen_vl_greedy for each prompt with its own images (`images` None: text only), run one at a
    time so that no padding enters transformers' side of a comparison."""
    images = images if images is not None else [[] for _ in prompts]
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
    return [
        hf_qwen_vl_greedy(path, prompt, imgs, max_new_tokens, precision, ignore_eos) for prompt, imgs in zip(prompts, images)
    ]


def hf_qwen_vl_logits(
    path: Path, prompt: str, images: list[PIL.Image.Image] | None, precision: Precision = CPU_FP32
) -> torch.Tensor:
    """transformers' next-token logits for the prompt's last position, as fp32 on the precision's device."""
    model, processor = _hf_qwen_vl(Path(path), precision)
    inputs = _inputs(processor, prompt, images, precision)
    with torch.inference_mode():
        return model(**inputs).logits[0, -1].float()
