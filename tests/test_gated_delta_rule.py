"""The gated delta rule's three ways (layers/gated_delta_rule.py) agree: chunked with recurrent over
lengths around the chunk size, varlen with one sequence at a time, the batched decode with one token of
recurrent, and, on a GPU with fla-core installed, fla's kernels with the PyTorch ones."""

from __future__ import annotations

import pytest
import torch

from mmengine.layers import gated_delta_rule as rule

HEADS, DK, DV = 4, 16, 8


def _inputs(n: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(n, HEADS, DK, generator=gen), dim=-1) * DK**-0.5
    k = torch.nn.functional.normalize(torch.randn(n, HEADS, DK, generator=gen), dim=-1)
    v = torch.randn(n, HEADS, DV, generator=gen)
    beta = torch.rand(n, HEADS, generator=gen)
    g = -torch.rand(n, HEADS, generator=gen) * 0.5
    state = torch.randn(HEADS, DK, DV, generator=gen) * 0.3
    return tuple(x.to(device) for x in (q, k, v, beta, g, state))


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 130])
def test_chunked_equals_the_recurrence(n):
    q, k, v, beta, g, state = _inputs(n, n)
    s_rec, s_chunk = state.clone(), state.clone()
    expected = rule.recurrent(q, k, v, beta, g, s_rec)
    got = rule.chunked(q, k, v, beta, g, s_chunk, chunk=16)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_chunk, s_rec, atol=1e-5, rtol=1e-4)


def test_varlen_runs_each_sequence_from_its_own_state():
    pieces = [_inputs(n, 10 + n) for n in (7, 1, 70)]
    cu = [0, 7, 8, 78]
    packed = [torch.cat([p[i] for p in pieces]) for i in range(5)]
    initial = torch.stack([p[5] for p in pieces])
    out, final = rule.varlen_torch(*packed, initial, cu)
    for i, p in enumerate(pieces):
        state = p[5].clone()
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], rule.recurrent(*p[:5], state), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(final[i], state, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(initial, torch.stack([p[5] for p in pieces]))  # the inputs are untouched


def test_the_batched_decode_is_one_step_of_the_recurrence():
    pieces = [_inputs(1, 30 + i) for i in range(3)]
    out, states = rule.decode_torch(*(torch.cat([p[i] for p in pieces]) for i in range(5)), torch.stack([p[5] for p in pieces]))
    for i, p in enumerate(pieces):
        state = p[5].clone()
        torch.testing.assert_close(out[i:i + 1], rule.recurrent(*p[:5], state), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(states[i], state, atol=1e-6, rtol=1e-5)


def test_without_fla_every_device_gets_the_pytorch_kernels():
    if rule.fla_kernels() is None:
        assert rule.kernels_for(torch.device("cpu")) == (rule.varlen_torch, rule.decode_torch)
        assert rule.kernels_for(torch.device("cuda")) == (rule.varlen_torch, rule.decode_torch)
    else:
        assert rule.kernels_for(torch.device("cpu")) == (rule.varlen_torch, rule.decode_torch)


@pytest.mark.skipif(not torch.cuda.is_available() or rule.fla_kernels() is None,
                    reason="needs a CUDA GPU with fla-core (the `fla` extra); the tests above check the PyTorch kernels it replaces")
def test_fla_kernels_equal_the_pytorch_ones():
    pieces = [_inputs(n, 50 + n, "cuda") for n in (7, 1, 130)]
    cu = [0, 7, 8, 138]
    packed = [torch.cat([p[i] for p in pieces]) for i in range(5)]
    initial = torch.stack([p[5] for p in pieces])
    varlen, decode = rule.fla_kernels()
    out, final = varlen(*packed, initial, cu)
    ref_out, ref_final = rule.varlen_torch(*packed, initial, cu)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(final.float(), ref_final, atol=2e-3, rtol=2e-3)
    ones = [_inputs(1, 90 + i, "cuda") for i in range(3)]
    args = [torch.cat([p[i] for p in ones]) for i in range(5)]
    states = torch.stack([p[5] for p in ones])
    for got, ref in zip(decode(*args, states), rule.decode_torch(*args, states)):
        torch.testing.assert_close(got.float(), ref, atol=2e-3, rtol=2e-3)
