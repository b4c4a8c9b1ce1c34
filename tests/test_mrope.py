"""M-RoPE (Qwen2-VL family): the prompt position table against transformers' `get_rope_index`, and
the rotary paths (reference and fused kernel) against transformers' per-channel cos/sin recomposed
by section."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf_qwen2_vl
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel, Qwen2VLRotaryEmbedding

from mmengine.kernels.rotary import rotary_store_kv
from mmengine.layers.rotary import RotaryEmbedding, rotary_reference
from mmengine.models.qwen_vl import mrope_positions

CUDA = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if CUDA else "cpu"  # without a GPU, Triton's interpreter (conftest.py)
HEAD_DIM, SECTION = 16, [2, 3, 3]
IMAGE = 7


def _config() -> Qwen2VLConfig:
    return Qwen2VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=32, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTION}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, spatial_merge_size=2),
        image_token_id=IMAGE, video_token_id=8, vision_start_token_id=9, vision_end_token_id=10,
    )


@pytest.mark.parametrize(
    "layout",
    [
        [("text", 5), ((1, 4, 6), None), ("text", 3)],  # one image, wider than tall
        # first in the prompt, varied sizes, separated as the chat template does (<|vision_end|><|vision_start|>)
        [((1, 6, 2), None), ("text", 2), ((1, 2, 2), None), ("text", 2), ((1, 8, 4), None), ("text", 4)],
        [("text", 9)],
    ],
    ids=["one-image", "three-sizes", "text-only"],
)
def test_prompt_positions_equal_transformers_get_rope_index(layout):
    ids, types, grids, runs = [], [], [], []
    for part, size in layout:
        if part == "text":
            ids += [1] * size
            types += [0] * size
            continue
        t, h, w = part
        length = t * h * w // 4
        runs.append((len(ids), length))
        grids.append((t, h, w))
        ids += [IMAGE] * length
        types += [1] * length
    ours = mrope_positions(len(ids), runs, grids, merge_size=2)
    model = Qwen2VLModel(_config())
    theirs, delta = model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
    assert torch.equal(torch.from_numpy(ours.table), theirs[:, 0].T)
    assert ours.delta == int(delta)


def _hf_rotated(q, k, positions, dtype):
    """transformers' M-RoPE: per-channel cos/sin, recomposed by section, applied to q and k (the
    recomposition sits in the rotary module, or in apply_multimodal_rotary_pos_emb in older versions)."""
    config = _config().text_config
    rotary = Qwen2VLRotaryEmbedding(config)
    cos, sin = rotary(torch.empty(1, dtype=dtype), positions.T[:, None, :])  # position_ids [3, 1, T]
    q_heads, k_heads = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    if hasattr(hf_qwen2_vl, "apply_multimodal_rotary_pos_emb"):
        q_hf, k_hf = hf_qwen2_vl.apply_multimodal_rotary_pos_emb(q_heads, k_heads, cos, sin, SECTION)
    else:
        q_hf, k_hf = hf_qwen2_vl.apply_rotary_pos_emb(q_heads, k_heads, cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


POSITIONS = torch.tensor([[0, 0, 0], [5, 5, 7], [5, 6, 5], [9, 9, 9], [40, 30, 20], [255, 0, 128]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_mrope_equals_transformers(dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(POSITIONS), 4, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(len(POSITIONS), 2, HEAD_DIM, generator=gen).to(dtype)
    with torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            table = RotaryEmbedding(_config().text_config, HEAD_DIM).cos_sin
        finally:
            torch.set_default_dtype(torch.float32)
    ours_q, ours_k = rotary_reference(q, k, POSITIONS, table, tuple(SECTION))
    hf_q, hf_k = _hf_rotated(q, k, POSITIONS, dtype)
    assert torch.equal(ours_q, hf_q) and torch.equal(ours_k, hf_k)


@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_kernel_mrope_rotates_and_stores_like_the_reference(dtype, interleaved):
    """Both layouts: Qwen2-VL's contiguous sections and Qwen3-VL's interleaved ones (same table)."""
    gen = torch.Generator().manual_seed(1)
    num_tokens = len(POSITIONS)
    q = torch.randn(num_tokens, 4, HEAD_DIM, generator=gen).to(KERNEL_DEVICE, dtype)
    k = torch.randn(num_tokens, 2, HEAD_DIM, generator=gen).to(KERNEL_DEVICE, dtype)
    v = torch.randn(num_tokens, 2, HEAD_DIM, generator=gen).to(KERNEL_DEVICE, dtype)
    torch.set_default_dtype(dtype)
    try:
        table = RotaryEmbedding(_config().text_config, HEAD_DIM).cos_sin.to(KERNEL_DEVICE)
    finally:
        torch.set_default_dtype(torch.float32)
    positions = POSITIONS.to(KERNEL_DEVICE)
    ref_q, ref_k = rotary_reference(q.clone(), k.clone(), positions, table, tuple(SECTION), mrope_interleaved=interleaved)
    cache = torch.zeros(2, 2, 4, 2, HEAD_DIM, device=KERNEL_DEVICE, dtype=dtype)
    slots = torch.tensor([0, 1, -1, 5, 6, 7], device=KERNEL_DEVICE)
    rotary_store_kv(q, k, v, positions, table, cache, slots, tuple(SECTION), mrope_interleaved=interleaved)
    tol = dict(atol=0, rtol=0) if not CUDA else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)
    flat_k = cache[0].view(-1, 2, HEAD_DIM)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], ref_k[row], **tol)


def test_equal_channels_are_plain_rope():
    """A text token (all three channels equal) rotates exactly as 1-D RoPE at that position."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, 4, HEAD_DIM, generator=gen), torch.randn(3, 2, HEAD_DIM, generator=gen)
    table = RotaryEmbedding(_config().text_config, HEAD_DIM).cos_sin
    flat = torch.tensor([3, 17, 200])
    mrope = rotary_reference(q, k, flat[:, None].expand(3, 3), table, tuple(SECTION))
    plain = rotary_reference(q, k, flat, table)
    assert torch.equal(mrope[0], plain[0]) and torch.equal(mrope[1], plain[1])


# -- Qwen3-VL: interleaved sections --------------------------------------------------------------


def _qwen3_text_config():
    from transformers import Qwen3VLTextConfig

    return Qwen3VLTextConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                             intermediate_size=64, vocab_size=32, max_position_embeddings=256,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTION,
                                              "mrope_interleaved": True})


def _qwen3_table(dtype: torch.dtype) -> torch.Tensor:
    torch.set_default_dtype(dtype)
    try:
        rotary = RotaryEmbedding(_qwen3_text_config(), HEAD_DIM)
    finally:
        torch.set_default_dtype(torch.float32)
    assert rotary.mrope_interleaved and rotary.mrope_section == tuple(SECTION)
    return rotary.cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interleaved_reference_equals_transformers_qwen3_vl(dtype):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(POSITIONS), 4, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(len(POSITIONS), 2, HEAD_DIM, generator=gen).to(dtype)
    ours_q, ours_k = rotary_reference(q, k, POSITIONS, _qwen3_table(dtype), tuple(SECTION), mrope_interleaved=True)
    cos, sin = Qwen3VLTextRotaryEmbedding(_qwen3_text_config())(torch.empty(1, dtype=dtype), POSITIONS.T[:, None, :])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1)) and torch.equal(ours_k, hf_k[0].transpose(0, 1))
    sectioned = rotary_reference(q, k, POSITIONS, _qwen3_table(dtype), tuple(SECTION))
    assert not torch.equal(sectioned[0], ours_q)  # the layouts differ on these positions
