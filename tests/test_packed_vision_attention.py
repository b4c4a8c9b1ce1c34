"""The Qwen vision towers run each layer's attention as one SDPA call per distinct sequence length (an
image's size, or a window's) and still equal transformers' tower, which calls SDPA once per image or window."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from mmengine.layers.packed_vision_attention import PACKED_ATTENTION, packed_attention_forward, plan_packed
from mmengine.models.qwen3_5_model import Qwen3_5Model
from mmengine.models.qwen_vl_model import QwenVLModel, _vision_tower_class
from mmengine.testing.qwen_vl import _build_config, _build_tokenizer, tiny_spec

FAMILIES = {"qwen2_vl": QwenVLModel, "qwen2_5_vl": QwenVLModel, "qwen3_vl": QwenVLModel, "qwen3_5": Qwen3_5Model}
# (t, h, w) in patches: two images of one size, one of another, and a two-frame video (a sequence per frame)
GRIDS = torch.tensor([[1, 12, 20], [1, 12, 20], [1, 8, 6], [2, 8, 8]])


class SdpaLog:
    """Records, per tower layer, the (batch, length) of every SDPA call the layer makes."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.calls: list[list[tuple[int, int]]] = []
        self._hooks = [block.register_forward_pre_hook(self._enter) for block in tower.blocks]

    def _enter(self, module, args) -> None:
        self.calls.append([])

    def record(self, query: torch.Tensor) -> None:
        self.calls[-1].append((query.shape[0], query.shape[-2]))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _run(tower: torch.nn.Module, pixels: torch.Tensor, monkeypatch) -> tuple[object, list[list[tuple[int, int]]]]:
    log = SdpaLog(tower)
    real = F.scaled_dot_product_attention

    def logged(query, *args, **kwargs):
        log.record(query)
        return real(query, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", logged)
    try:
        with torch.inference_mode():
            return tower(pixels, grid_thw=GRIDS), log.calls
    finally:
        monkeypatch.setattr(F, "scaled_dot_product_attention", real)
        log.close()


@pytest.fixture(scope="module")
def tokenizer():
    return _build_tokenizer(400)


def _towers(family: str, tokenizer, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' tower and the engine's model's tower (packed attention), with the same weights."""
    torch.manual_seed(0)
    config = _build_config(tiny_spec(family), tokenizer)
    theirs = _vision_tower_class(config.model_type)._from_config(copy.deepcopy(config.vision_config)).eval()
    model = FAMILIES[family](config).eval()
    model.visual.load_state_dict(theirs.state_dict())
    assert theirs.config._attn_implementation == "sdpa"
    assert model.visual.config._attn_implementation == PACKED_ATTENTION
    assert config.vision_config._attn_implementation == "sdpa", "the checkpoint's config stays as it was"
    return theirs.to(device, dtype), model.visual.to(device, dtype)


def _pixels(tower: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.Tensor:
    vision = tower.config
    channels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return torch.randn(int(GRIDS.prod(-1).sum()), channels, generator=torch.Generator().manual_seed(1)).to(device, dtype)


def _check_calls(calls: list[list[tuple[int, int]]], ref_calls: list[list[tuple[int, int]]], windowed: bool) -> None:
    assert len(calls) == len(ref_calls)
    for layer, (mine, their) in enumerate(zip(calls, ref_calls)):
        assert all(batch == 1 for batch, _ in their)
        lengths = [length for _, length in mine]
        assert len(lengths) == len(set(lengths)), f"layer {layer}: one call per distinct length, got {mine}"
        assert Counter({length: batch for batch, length in mine}) == Counter(length for _, length in their)
    assert sum(map(len, ref_calls)) > sum(map(len, calls)) * (3 if windowed else 1.5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_call_per_length_and_the_same_output(family, tokenizer, monkeypatch):
    theirs, tower = _towers(family, tokenizer, "cpu", torch.float32)
    pixels = _pixels(tower, "cpu", torch.float32)
    ref, ref_calls = _run(theirs, pixels, monkeypatch)
    out, calls = _run(tower, pixels, monkeypatch)

    assert torch.equal(out.pooler_output, ref.pooler_output)  # CPU fp32: bit for bit
    for mine, their in zip(getattr(out, "deepstack_features", None) or [], getattr(ref, "deepstack_features", None) or []):
        assert torch.equal(mine, their)
    assert len(calls) == len(tower.blocks)
    _check_calls(calls, ref_calls, windowed=family == "qwen2_5_vl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU test above checks the same in fp32")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_on_cuda_one_call_per_length_and_transformers_output(family, dtype, tokenizer, monkeypatch):
    """On a GPU, SDPA picks its flash or memory-efficient kernels: batched windows must still give transformers'
    per-window output (within the dtype's rounding: a kernel may tile a batch differently)."""
    theirs, tower = _towers(family, tokenizer, "cuda", dtype)
    pixels = _pixels(tower, "cuda", dtype)
    ref, ref_calls = _run(theirs, pixels, monkeypatch)
    out, calls = _run(tower, pixels, monkeypatch)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=2e-2, atol=2e-2)
    _check_calls(calls, ref_calls, windowed=family == "qwen2_5_vl")


def test_plan_groups_by_length_and_views_adjacent_sequences():
    plan = plan_packed(torch.tensor([0, 4, 8, 8, 11, 13, 16]))
    assert plan.total == 16
    by_length = {group.length: group for group in plan.groups}
    assert set(by_length) == {4, 3, 2}, "the empty sequence is dropped"
    assert [by_length[n].count for n in (4, 3, 2)] == [2, 2, 1]
    assert by_length[4].rows == slice(0, 8), "adjacent sequences are a view"
    assert by_length[2].rows == slice(11, 13)
    assert torch.equal(by_length[3].rows, torch.tensor([8, 9, 10, 13, 14, 15]))


def test_packed_attention_equals_attention_per_sequence():
    torch.manual_seed(1)
    bounds = [0, 5, 10, 13, 18, 20]
    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    out, _ = packed_attention_forward(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=torch.tensor(bounds))
    for start, end in zip(bounds, bounds[1:]):
        one = F.scaled_dot_product_attention(q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], scale=0.3)
        assert torch.equal(out[0, start:end], one[0].transpose(0, 1))


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(attention_mask=torch.ones(1, 1, 4, 4)), "mask"),
        (dict(attention_mask=None, is_causal=True), "causal"),
        (dict(attention_mask=None, dropout=0.1), "dropout"),
        (dict(attention_mask=None), "cu_seqlens"),
        (dict(attention_mask=None, cu_seq_lens_k=torch.tensor([0, 4])), "cu_seqlens"),
    ],
)
def test_refuses_what_it_does_not_do(kwargs, names):
    q = torch.randn(1, 1, 4, 8)
    kwargs.setdefault("cu_seq_lens_q", torch.tensor([0, 2, 4]) if "cu_seq_lens_k" in kwargs else None)
    with pytest.raises(ValueError, match=names):
        packed_attention_forward(None, q, q, q, **kwargs)
