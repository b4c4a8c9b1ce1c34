"""The fused MoE Triton kernel (kernels/fused_moe.py) equals the PyTorch experts (layers/moe.py) in
Triton's interpreter on CPU (compiled on a GPU), fp32 and fp16, over expert counts, top-k and token
counts, experts that receive no token included; and the alignment it rests on."""

from __future__ import annotations

import copy

import pytest
import torch

from mmengine.kernels.fused_moe import BLOCK_M, align_by_expert, fused_moe
from mmengine.layers.moe import FusedExperts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(num_experts: int, top_k: int, num_tokens: int, hidden: int, inter: int, dtype: torch.dtype, seed: int,
          activation: str = "silu"):
    gen = torch.Generator().manual_seed(seed)
    experts = FusedExperts(num_experts, hidden, inter, activation)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2)
        experts.down_proj.copy_(torch.randn(num_experts, hidden, inter, generator=gen) * 0.2)
    experts = experts.to(DEVICE, dtype)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    # a skewed draw: a few experts take most pairs and some get none
    scores = torch.randn(num_tokens, num_experts, generator=gen) + torch.linspace(2, -2, num_experts)
    ids = scores.topk(top_k, dim=-1).indices.to(DEVICE)
    weights = torch.rand(num_tokens, top_k, generator=gen).softmax(-1).to(DEVICE, dtype)
    return experts, x, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_experts,top_k,num_tokens,hidden,inter", [
    (1, 1, 1, 32, 16), (3, 2, 7, 48, 24), (8, 2, 33, 32, 40), (64, 8, 300, 32, 16), (16, 4, 130, 40, 32),
    (64, 1, 3, 32, 16),  # most experts get no token
])
def test_the_kernel_equals_the_pytorch_experts(num_experts, top_k, num_tokens, hidden, inter, dtype, activation="silu"):
    experts, x, weights, ids = _case(num_experts, top_k, num_tokens, hidden, inter, dtype, seed=num_experts * 7 + top_k,
                                     activation=activation)
    with torch.no_grad():
        expected = copy.deepcopy(experts).float()(x.float(), weights.float(), ids)  # fp16: against an fp32 reference
        got = fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, activation=activation)
    if num_experts == 64 and top_k == 1:
        assert len(set(ids.flatten().tolist())) <= 3
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    assert got.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_experts,top_k,num_tokens,hidden,inter", [(3, 2, 7, 48, 24), (16, 4, 130, 40, 32)])
def test_gelu_tanh_experts_equal_the_pytorch_experts(num_experts, top_k, num_tokens, hidden, inter, dtype):
    """GELU's tanh approximation as the gate's activation (Gemma 4's experts)."""
    test_the_kernel_equals_the_pytorch_experts(num_experts, top_k, num_tokens, hidden, inter, dtype, "gelu_pytorch_tanh")


@pytest.mark.parametrize("bits", [False, True], ids=["e4m3", "bits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_experts,top_k,num_tokens,hidden,inter,group_k", [
    (8, 2, 33, 64, 48, 32), (4, 1, 5, 40, 24, 16), (16, 4, 70, 48, 40, 48),
])
def test_fp8_experts_equal_their_dequantized_weights(num_experts, top_k, num_tokens, hidden, inter, group_k, dtype, bits):
    """e4m3 experts with block scales (as an FP8 checkpoint's, repeated over each block's rows) give what
    the same experts dequantized to the activations' dtype give; read as e4m3 or as their bits (the path
    before compute capability 8.9, where Triton has no e4m3 type)."""
    if not bits and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 type needs compute capability 8.9+; fused_moe reads the bits here (the `bits` cases)")
    experts, x, weights, ids = _case(num_experts, top_k, num_tokens, hidden, inter, dtype, seed=num_experts + group_k)
    gen = torch.Generator().manual_seed(group_k)

    def quantized(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, cols = dense.shape[1], dense.shape[2]
        scales = torch.rand(dense.shape[0], rows, -(-cols // group_k), generator=gen) * 2e-3 + 1e-3
        full = scales.repeat_interleave(group_k, 2)[..., :cols]
        fp8 = (dense.float().cpu() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        return fp8.to(DEVICE), scales.to(DEVICE), (fp8.float() * full).to(DEVICE, dtype)

    gate_up, gate_up_scales, gate_up_dense = quantized(experts.gate_up_proj.detach())
    down, down_scales, down_dense = quantized(experts.down_proj.detach())
    with torch.no_grad():
        expected = fused_moe(x, gate_up_dense, down_dense, weights, ids)
        if bits:
            gate_up, down = gate_up.view(torch.uint8), down.view(torch.uint8)
        got = fused_moe(x, gate_up, down, weights, ids, gate_up_scales, down_scales, group_k)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    with pytest.raises(ValueError, match=f"do not cover {hidden} inputs in groups of 8"):
        fused_moe(x, gate_up, down, weights, ids, gate_up_scales, down_scales, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_experts,top_k,num_tokens,hidden,inter,group", [
    (8, 2, 33, 64, 48, 32), (4, 1, 5, 40, 24, 8), (16, 4, 70, 48, 40, 16), (3, 2, 17, 96, 56, 64),
])
def test_int4_experts_equal_their_dequantized_weights(num_experts, top_k, num_tokens, hidden, inter, group, dtype):
    """Experts in the W4A16 GEMM's packing (qweight [E, inputs / 8, outputs], scales and zeros per group of
    inputs, gate and up side by side along the outputs) give what the same experts dequantized give;
    groups that do not divide the inputs (a last partial group) included."""
    from mmengine.models.quantization import pack_int4

    _, x, weights, ids = _case(num_experts, top_k, num_tokens, hidden, inter, dtype, seed=num_experts + group)
    gen = torch.Generator().manual_seed(group)

    def quantized(inputs: int, outputs: int) -> tuple[torch.Tensor, ...]:
        q = torch.randint(0, 16, (num_experts, inputs, outputs), generator=gen)
        groups = -(-inputs // group)
        scales = (torch.rand(num_experts, groups, outputs, generator=gen) * 0.02 + 0.01).to(dtype)
        zeros = torch.randint(0, 16, (num_experts, groups, outputs), generator=gen).to(dtype)
        dense = (q - zeros.float().repeat_interleave(group, 1)[:, :inputs]) * scales.float().repeat_interleave(group, 1)[:, :inputs]
        return pack_int4(q, 1).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), dense.transpose(1, 2).to(DEVICE, dtype)

    gate_up, gate_up_scales, gate_up_zeros, gate_up_dense = quantized(hidden, 2 * inter)
    down, down_scales, down_zeros, down_dense = quantized(inter, hidden)
    with torch.no_grad():
        expected = fused_moe(x, gate_up_dense.contiguous(), down_dense.contiguous(), weights, ids)
        got = fused_moe(x, gate_up, down, weights, ids, gate_up_scales, down_scales, group, gate_up_zeros, down_zeros)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    with pytest.raises(ValueError, match=f"int4 expert weights .* do not cover {hidden} inputs in groups of {2 * group}"):
        fused_moe(x, gate_up, down, weights, ids, gate_up_scales, down_scales, 2 * group, gate_up_zeros, down_zeros)


def test_alignment_groups_pairs_by_expert_in_padded_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]])
    pairs, tile_expert, num_padded = align_by_expert(ids, num_experts=4, block_m=4)
    flat = ids.flatten()
    used = pairs[: int(num_padded)]
    assert int(num_padded) == 4 + 4 + 4  # experts 0 (3 pairs), 1 (1), 2 (4): one tile each; expert 3 none
    for tile, expert in enumerate(tile_expert[: int(num_padded) // 4].tolist()):
        rows = used[tile * 4:(tile + 1) * 4]
        real = rows[rows < flat.numel()]
        assert (flat[real] == expert).all() and real.tolist() == sorted(real.tolist())
    assert sorted(used[used < flat.numel()].tolist()) == list(range(flat.numel()))
    assert (tile_expert[int(num_padded) // 4:] == -1).all()
    assert pairs.numel() % 4 == 0 and pairs.numel() >= flat.numel() + 4 * 3  # a fixed upper size: no count read back
    assert BLOCK_M == 16
