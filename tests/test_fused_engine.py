"""The engine end to end on the fused decoder kernels (Triton's interpreter on CPU, natively on a
GPU): the same greedy tokens as the PyTorch reference path, with every fused kernel actually used
and K/V stored once (by the rotary kernel, never by the backend)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import mmengine.kernels.activation as activation_kernels
import mmengine.kernels.rms_norm as norm_kernels
import mmengine.kernels.rotary as rotary_kernels
from mmengine import MMEngine, SamplingParams
from mmengine.layers.torch_attention import TorchAttentionBackend
from mmengine.layers.triton_attention import TritonAttentionBackend
from mmengine.testing import TinyLlavaSpec, make_test_image

# fp32 on the device the kernels compile for: CUDA when present, else the interpreter on CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

PROMPTS = [
    "USER: <image>\nWhat is shown here? ASSISTANT:",
    "USER: hello there, tell me a story ASSISTANT:",
    "USER: <image>\nWhat is shown here? Tell me more. ASSISTANT:",
]
IMAGES = [[make_test_image(1)], [], [make_test_image(1)]]


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts launches of each fused kernel and of each backend's separate K/V store."""
    counter: Counter = Counter()

    def spy(owner, name):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            counter[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    for owner, name in [(rotary_kernels, "rotary_store_kv"), (norm_kernels, "rms_norm"), (norm_kernels, "fused_add_rms_norm"),
                        (activation_kernels, "silu_and_mul")]:
        spy(owner, name)
    for backend in (TorchAttentionBackend, TritonAttentionBackend):
        original = backend.store_kv

        def store(self, *args, _original=original, _name=backend.name, **kwargs):
            counter[f"store_kv[{_name}]"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(backend, "store_kv", store)
    return counter


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(TinyLlavaSpec(), id="llama-d16"),
        pytest.param(TinyLlavaSpec(text_model="qwen2", hidden_size=160, num_attention_heads=2, num_key_value_heads=1), id="qwen2-d80"),
    ],
)
def test_fused_path_gives_the_reference_tokens(checkpoint_dir, calls, spec):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    kwargs = dict(max_model_len=256, block_size=16, max_num_batched_tokens=24)  # chunked prefill, mixed steps
    tokens, counts = {}, {}
    for backend in ("torch", "triton"):
        calls.clear()
        engine = MMEngine(str(checkpoint_dir(spec)), attn_backend=backend, device=DEVICE, dtype="float32",
                          enforce_eager=True, **kwargs)  # every launch goes through Python, where it is counted
        first = engine.generate(PROMPTS, images=IMAGES, sampling_params=params, use_tqdm=False)
        second = engine.generate(PROMPTS, images=IMAGES, sampling_params=params, use_tqdm=False)  # prefix hits: slot -1 rows
        assert engine.stats()["prefix_cache_hits"] > 0
        tokens[backend] = [o.token_ids for o in first + second]
        counts[backend] = dict(calls)
    assert tokens["triton"] == tokens["torch"]

    layers = spec.num_hidden_layers
    fused = counts["triton"]
    steps = fused["rotary_store_kv"] // layers
    assert steps > 0 and fused["rotary_store_kv"] == steps * layers
    assert fused["rms_norm"] == steps  # the first layer's input norm only
    assert fused["fused_add_rms_norm"] == steps * 2 * layers  # every other norm, the final one included
    assert fused["silu_and_mul"] == steps * layers
    assert "store_kv[triton]" not in fused and "store_kv[torch]" not in fused  # K/V stored once, by the rotary kernel
    if DEVICE == "cpu":  # the reference path on a CPU launches no kernel and stores through its backend
        assert counts["torch"] == {"store_kv[torch]": steps * layers}
    else:  # on a GPU the small ops take the fused kernels whatever the attention backend
        assert counts["torch"] == fused
