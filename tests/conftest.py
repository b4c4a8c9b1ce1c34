"""Shared fixtures: tiny random-weight checkpoints built with transformers, and transformers' own greedy output."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; the variable must be set before
# any kernel is decorated, i.e. before mmengine.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmengine.testing import TinyLlavaSpec, tiny_llava_path


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint_dir(spec) -> path of a tiny checkpoint built once per test session."""
    root = tmp_path_factory.mktemp("checkpoints")

    @functools.cache
    def build(spec: TinyLlavaSpec = TinyLlavaSpec()) -> Path:
        return tiny_llava_path(spec, cache_dir=root)

    return build


@functools.cache
def _hf_model(path: Path) -> tuple[LlavaForConditionalGeneration, object]:
    model = LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(path))


def hf_greedy(path: Path, prompt: str, images: list | None, max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' LlavaForConditionalGeneration.generate (the correctness anchor)."""
    model, processor = _hf_model(path)
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def hf_logits(path: Path, prompt: str, images: list | None) -> torch.Tensor:
    """transformers' next-token logits for the prompt's last position."""
    model, processor = _hf_model(path)
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        return model(**inputs).logits[0, -1].float()
