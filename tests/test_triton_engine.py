"""The engine end to end on the Triton kernels: the same greedy tokens as the PyTorch reference
(in Triton's interpreter on CPU, natively on a GPU). Both run in fp32, the only dtype where greedy
tokens are comparable; the bf16 kernels are checked against the reference in test_triton_kernels.py."""

from __future__ import annotations

import pytest

from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError
from mmengine.testing import TinyLlavaSpec, make_test_image

PROMPTS = [
    "USER: <image>\nWhat is shown here? ASSISTANT:",
    "USER: hello there, tell me a story ASSISTANT:",
    "USER: <image>\nWhat is shown here? Tell me more. ASSISTANT:",
    "USER: <image> and <image>\nCompare them. ASSISTANT:",
]
IMAGES = [[make_test_image(1)], [], [make_test_image(1)], [make_test_image(2), make_test_image(1)]]


def test_triton_backend_matches_the_reference(checkpoint_dir, no_tf32):
    """Chunked prefill (a budget smaller than the prompts), prefix hits (shared prefixes, then a
    repeat of the whole batch), mixed prefill/decode steps and split-KV decode. (3 tokens a request: decode-only steps
    too, each decode a program per request, KV head and split in the interpreter.)"""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    kwargs = dict(max_model_len=256, block_size=16, max_num_batched_tokens=24, dtype="float32")
    results = {}
    for backend in ("torch", "triton"):
        engine = MMEngine(str(checkpoint_dir()), attn_backend=backend, **kwargs)
        if backend == "triton":
            engine.runner.attn_backend.num_splits = 4  # several splits even for these short contexts
        first = engine.generate(PROMPTS, images=IMAGES, sampling_params=params, use_tqdm=False)
        second = engine.generate(PROMPTS, images=IMAGES, sampling_params=params, use_tqdm=False)
        assert engine.stats()["prefix_cache_hits"] > 0 and engine.runner.attn_backend.name == backend
        results[backend] = [o.token_ids for o in first + second]
    assert results["triton"] == results["torch"]


def test_triton_backend_with_a_gqa_group_of_three(checkpoint_dir, no_tf32):
    """6 query heads over 2 KV heads (a group that is not a power of two, like Qwen2-7B's 7), on a
    Qwen2 text model: mixed prefill and decode steps give the reference's greedy tokens."""
    spec = TinyLlavaSpec(text_model="qwen2", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = MMEngine(
            str(checkpoint_dir(spec)), attn_backend=backend, max_model_len=256, max_num_batched_tokens=32, dtype="float32"
        )
        outputs = engine.generate(PROMPTS[:3], images=IMAGES[:3], sampling_params=params, use_tqdm=False)
        tokens[backend] = [o.token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]


def test_triton_needs_a_gpu_or_the_interpreter(checkpoint_dir, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU the Triton backend is always available")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        MMEngine(str(checkpoint_dir()), attn_backend="triton", max_model_len=256)
    assert MMEngine(str(checkpoint_dir()), max_model_len=256).runner.attn_backend.name == "torch"  # auto on CPU
