"""The Gated DeltaNet layer (Qwen3.5's linear attention) on its PyTorch path: equal to transformers'
own Qwen3_5GatedDeltaNet on the same weights (fp32 CPU), and a request's state carried across steps
(chunks of any size, decode tokens, other requests packed beside it) gives the output of one pass."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from mmengine.layers.gated_delta import GatedDeltaNet, GatedDeltaShape, GatedDeltaStates


def _config() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=12, intermediate_size=64, vocab_size=64)


@pytest.fixture(scope="module")
def layers():
    torch.manual_seed(0)
    config = _config()
    reference = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():  # random gates and decays, not the init's constants
        reference.dt_bias.normal_(0, 0.5)
        reference.norm.weight.normal_(1, 0.2)
    ours = GatedDeltaNet(GatedDeltaShape.of(config)).eval()
    missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=True)
    assert not missing and not unexpected  # the checkpoint's names, one to one
    return reference, ours


def _ours(layer: GatedDeltaNet, pieces: list[list[torch.Tensor]], num_slots: int) -> list[torch.Tensor]:
    """Runs `pieces` (per step, one tensor [n, H] per request, request i in slot i) and returns each
    request's outputs concatenated over the steps."""
    states = GatedDeltaStates(layer.shape, num_slots, torch.device("cpu"), torch.float32)
    outputs: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]
    for step in pieces:
        starts = [0]
        for piece in step:
            starts.append(starts[-1] + piece.shape[0])
        with torch.no_grad():
            out = layer(torch.cat(step), starts, list(range(len(step))), states)
        for i in range(len(step)):
            outputs[i].append(out[starts[i]:starts[i + 1]])
    return [torch.cat(chunks) for chunks in outputs]


def test_one_pass_equals_transformers(layers):
    reference, ours = layers
    hidden = torch.randn(1, 23, 48)
    with torch.no_grad():
        expected = reference(hidden)[0]
    (got,) = _ours(ours, [[hidden[0]]], 1)
    assert expected.abs().mean() > 1e-3  # a real signal, not zeros on both sides
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunks", [[8, 8, 7], [1] * 23, [3, 1, 1, 17, 1], [22, 1]])
def test_the_state_carries_across_steps(layers, chunks):
    reference, ours = layers
    hidden = torch.randn(23, 48)
    with torch.no_grad():
        expected = reference(hidden[None])[0]
    steps, start = [], 0
    for size in chunks:
        steps.append([hidden[start:start + size]])
        start += size
    (got,) = _ours(ours, steps, 1)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_packed_requests_each_get_what_they_get_alone(layers):
    reference, ours = layers
    a, b = torch.randn(10, 48), torch.randn(7, 48)
    with torch.no_grad():
        alone = [reference(x[None])[0] for x in (a, b)]
    got = _ours(ours, [[a[:6], b[:3]], [a[6:], b[3:4]], [a[:0], b[4:]]], 2)  # a request may have no token in a step
    for g, e in zip(got, alone):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-4)


def test_a_reset_slot_starts_from_nothing(layers):
    _, ours = layers
    x = torch.randn(5, 48)
    states = GatedDeltaStates(ours.shape, 1, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        first = ours(x, [0, 5], [0], states)
        continued = ours(x, [0, 5], [0], states)
        states.reset(0)
        again = ours(x, [0, 5], [0], states)
    assert not torch.allclose(first, continued)  # the second pass continued the first's state
    torch.testing.assert_close(again, first)
