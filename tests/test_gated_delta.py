"""The Gated DeltaNet layer (Qwen3.5's linear attention) on its PyTorch path: equal to transformers'
own Qwen3_5GatedDeltaNet on the same weights (fp32 CPU), and a request's state carried across steps
(chunks of any size, decode tokens, other requests packed beside it) gives the output of one pass."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from mmengine.layers.gated_delta import GatedDeltaNet, GatedDeltaShape, GatedDeltaStates, RecurrentStep


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
    layer.states = GatedDeltaStates(layer.shape, num_slots, torch.device("cpu"), torch.float32)
    outputs: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]
    for step in pieces:
        starts = [0]
        for piece in step:
            starts.append(starts[-1] + piece.shape[0])
        with torch.no_grad():
            out = layer(torch.cat(step), RecurrentStep(starts, list(range(len(step)))))
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
    ours.states = states = GatedDeltaStates(ours.shape, 1, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        first = ours(x, RecurrentStep([0, 5], [0]))
        continued = ours(x, RecurrentStep([0, 5], [0]))
        states.reset(0)
        again = ours(x, RecurrentStep([0, 5], [0]))
    assert not torch.allclose(first, continued)  # the second pass continued the first's state
    torch.testing.assert_close(again, first)


def test_saves_copy_the_state_as_it_stands_after_that_many_tokens(layers):
    """A chunk of 9 tokens saving after 4 and after 9 leaves the states of a 4-token and of a
    9-token pass in those slots: continuing either gives what one pass gives."""
    reference, ours = layers
    x = torch.randn(13, 48)
    with torch.no_grad():
        expected = reference(x[None])[0]
        ours.states = states = GatedDeltaStates(ours.shape, 3, torch.device("cpu"), torch.float32)
        first = ours(x[:9], RecurrentStep([0, 9], [0], [[(4, 1), (9, 2)]]))
        torch.testing.assert_close(states.recurrent[0], states.recurrent[2])  # a save at the chunk's end is the live state
        from_four = ours(x[4:], RecurrentStep([0, 9], [1]))
        from_nine = ours(x[9:], RecurrentStep([0, 4], [2]))
    torch.testing.assert_close(first, expected[:9], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(from_four, expected[4:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(from_nine, expected[9:], atol=2e-5, rtol=1e-4)


def test_decodes_batched_equal_decodes_alone(layers):
    _, ours = layers
    prompts = [torch.randn(n, 48) for n in (3, 6, 1)]
    steps = [torch.randn(3, 48) for _ in range(4)]
    with torch.no_grad():
        ours.states = GatedDeltaStates(ours.shape, 3, torch.device("cpu"), torch.float32)
        for i, p in enumerate(prompts):
            ours(p, RecurrentStep([0, p.shape[0]], [i]))
        saved = (ours.states.conv.clone(), ours.states.recurrent.clone())
        together = [ours(x, RecurrentStep([0, 1, 2, 3], [2, 0, 1])) for x in steps]
        ours.states.conv.copy_(saved[0])
        ours.states.recurrent.copy_(saved[1])
        alone = [torch.cat([ours(x[j:j + 1], RecurrentStep([0, 1], [slot])) for j, slot in enumerate([2, 0, 1])]) for x in steps]
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_stepwise_requests_run_as_decodes_and_save_after_each_token(layers):
    """A verify step's request (stepwise): its 4 tokens give the outputs and states of decoding them one at a
    time (to the last bits of the projections, which see the step's other rows), with a save after tokens 1,
    2 and 3; a plain request in the same step runs as before."""
    reference, ours = layers
    x, other = torch.randn(4, 48), torch.randn(6, 48)
    with torch.no_grad():
        expected_other = reference(other[None])[0]
        ours.states = one_by_one = GatedDeltaStates(ours.shape, 1, torch.device("cpu"), torch.float32)
        singles, states_after = [], []
        for t in range(4):
            singles.append(ours(x[t : t + 1], RecurrentStep([0, 1], [0])))
            states_after.append(one_by_one.recurrent[0].clone())
        ours.states = states = GatedDeltaStates(ours.shape, 5, torch.device("cpu"), torch.float32)
        step = RecurrentStep([0, 4, 10], [0, 4], [[(1, 1), (2, 2), (3, 3)], []], stepwise=frozenset({0}))
        out = ours(torch.cat([x, other]), step)
    torch.testing.assert_close(out[:4], torch.cat(singles), atol=1e-6, rtol=1e-5)
    for n in (1, 2, 3):
        torch.testing.assert_close(states.recurrent[n], states_after[n - 1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(states.recurrent[0], states_after[3], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(states.recurrent[1], states.recurrent[2])  # each save took its own moment
    torch.testing.assert_close(out[4:], expected_other, atol=2e-5, rtol=1e-4)
