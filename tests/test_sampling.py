"""SamplingParams validation and the batched Sampler."""

from __future__ import annotations

import pytest
import torch

from mmengine.errors import ConfigError
from mmengine.sample.params import SamplingParams
from mmengine.sample.sampler import Sampler

CPU = torch.device("cpu")


# --- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("max_tokens", "16"),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1"),
        ("temperature", None),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_p", float("nan")),
        ("top_p", "0.9"),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", False),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", 1.0),
        ("seed", "7"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1, 2.0]),
        ("stop_token_ids", 5),
        ("stop_token_ids", [True]),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop", 3),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_params_raise_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)
    assert repr(value) in str(info.value)


def test_params_are_normalised() -> None:
    params = SamplingParams(stop="###", stop_token_ids=(3, 4), temperature=1, top_p=1)
    assert params.stop == ["###"]
    assert params.stop_token_ids == [3, 4]
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_defaults_and_greedy() -> None:
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, 0)
    assert params.seed is None and params.stop == [] and params.stop_token_ids == [] and not params.ignore_eos
    assert not params.greedy
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(top_k=-1).greedy  # -1 is accepted (disabled)


def test_make_generator() -> None:
    sampler = Sampler()
    assert sampler.make_generator(SamplingParams(seed=3, temperature=0.0), CPU) is None
    assert sampler.make_generator(SamplingParams(), CPU) is None
    generator = sampler.make_generator(SamplingParams(seed=3), CPU)
    assert isinstance(generator, torch.Generator) and generator.initial_seed() == 3


# --- Sampler ----------------------------------------------------------------------------------


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    generators = [sampler.make_generator(p, logits.device) for p in params]
    return sampler(logits, params, generators)


def _repeat(probs: list[float], n: int) -> torch.Tensor:
    """n identical rows of logits whose softmax is `probs`."""
    return torch.tensor(probs).log().expand(n, -1).contiguous()


def test_greedy_is_argmax_with_first_max_on_ties() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # tie: the first index wins
    tokens = _sample(Sampler(), logits, [SamplingParams(temperature=0.0)] * 6)
    assert tokens.dtype == torch.int64 and tokens.shape == (6,) and tokens.device == logits.device
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[2].item() == 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(seed=5), SamplingParams()]
    tokens = _sample(Sampler(), logits, params)
    assert tokens.dtype == torch.int64 and tokens.shape == (4,)
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(2)) * 3
    greedy = logits.argmax(dim=-1)
    sampler = Sampler(seed=1)
    for temperature in (0.3, 1.0, 5.0):
        top_k = [SamplingParams(temperature=temperature, top_k=1)] * 32
        top_p = [SamplingParams(temperature=temperature, top_p=1e-6)] * 32
        assert torch.equal(_sample(sampler, logits, top_k), greedy)
        assert torch.equal(_sample(sampler, logits, top_p), greedy)


def test_tiny_temperature_does_not_produce_nan() -> None:
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(3)) * 50
    tokens = _sample(Sampler(), logits, [SamplingParams(temperature=1e-30)] * 4)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_masked_tokens_are_never_sampled() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 4000
    sampler = Sampler(seed=0)
    counts_k = _sample(sampler, _repeat(probs, n), [SamplingParams(top_k=2)] * n).bincount(minlength=4)
    counts_p = _sample(sampler, _repeat(probs, n), [SamplingParams(top_p=0.75)] * n).bincount(minlength=4)
    for counts in (counts_k, counts_p):
        assert counts[2] == 0 and counts[3] == 0
        # The kept tokens are renormalised: 0.5 / 0.8 = 0.625, with sd ~0.008 at n = 4000.
        assert abs(counts[0].item() / n - 0.625) < 0.04


def test_top_p_keeps_the_token_that_reaches_p() -> None:
    # Token 0 alone has 0.5 < 0.6, so token 1 (which reaches 0.8 >= 0.6) is kept too; token 2 is not.
    n = 2000
    counts = _sample(Sampler(seed=0), _repeat([0.5, 0.3, 0.2], n), [SamplingParams(top_p=0.6)] * n)
    counts = counts.bincount(minlength=3)
    assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0


def test_per_row_filters_in_one_batch() -> None:
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    rows = [
        SamplingParams(top_k=1),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(top_k=4, top_p=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(),
    ]
    allowed = [{0}, {0, 1, 2}, {0, 1}, {0, 1, 2}, {0}, {0, 1, 2, 3, 4}]
    seen: list[set[int]] = [set() for _ in rows]
    sampler = Sampler(seed=0)
    reps = 300
    params = rows * reps
    tokens = _sample(sampler, _repeat(probs, len(params)), params).tolist()
    for i, token in enumerate(tokens):
        seen[i % len(rows)].add(token)
    assert seen == allowed


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_softmax_over_temperature(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.2, -0.5])
    expected = (logits / temperature).softmax(dim=-1)
    n = 20000
    params = [SamplingParams(temperature=temperature)] * n
    counts = _sample(Sampler(seed=0), logits.expand(n, -1).contiguous(), params).bincount(minlength=3)
    chi_square = (((counts - n * expected) ** 2) / (n * expected)).sum().item()
    assert chi_square < 13.8  # p = 0.001 for 2 degrees of freedom


def _seeded_run(target: SamplingParams, position: int, others: list[SamplingParams], steps: list[torch.Tensor]) -> list[int]:
    """Tokens of `target` over several steps when it sits at `position` among `others`."""
    sampler = Sampler(seed=position)  # the unseeded rows get different noise every run
    batch = others[:position] + [target] + others[position:]
    generators = [sampler.make_generator(p, CPU) for p in batch]
    out = []
    for step_logits in steps:
        rows = torch.randn(len(batch), step_logits.shape[0])
        rows[position] = step_logits
        out.append(sampler(rows, batch, generators)[position].item())
    return out


def _steps(n: int, vocab: int = 1000) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(42)
    return [torch.randn(vocab, generator=generator) * 0.5 for _ in range(n)]


def test_seeded_rows_are_reproducible_whatever_the_batch() -> None:
    steps = _steps(6)
    target = SamplingParams(seed=1234, temperature=0.9, top_p=0.95)
    batches = [
        [],
        [SamplingParams(temperature=0.0)],
        [SamplingParams(), SamplingParams(seed=1234), SamplingParams(seed=7, top_k=5)],
        [SamplingParams(seed=99), SamplingParams(temperature=0.0), SamplingParams(top_k=3), SamplingParams()],
    ]
    runs = [_seeded_run(target, position, others, steps) for others in batches for position in range(len(others) + 1)]
    assert all(run == runs[0] for run in runs)
    assert len(set(runs[0])) > 1  # the steps really sample


def test_different_seeds_give_different_tokens() -> None:
    steps = _steps(6)
    runs = {tuple(_seeded_run(SamplingParams(seed=seed), 0, [], steps)) for seed in range(5)}
    assert len(runs) == 5


def test_unseeded_sampler_is_deterministic_per_sampler_seed() -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams()] * 8
    first = _sample(Sampler(seed=3), logits, params)
    assert torch.equal(first, _sample(Sampler(seed=3), logits, params))
    assert not torch.equal(first, _sample(Sampler(seed=4), logits, params))


def test_mismatched_shapes_raise() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_mixed_batch_stays_on_device() -> None:
    device = torch.device("cuda")
    logits = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams(top_k=2), SamplingParams(top_p=0.5)]
    sampler = Sampler()
    generators = [sampler.make_generator(p, device) for p in params]
    tokens = sampler(logits, params, generators)
    assert tokens.device.type == "cuda" and tokens.dtype == torch.int64
    assert tokens[0] == logits[0].argmax()
    again = sampler(logits, params, [sampler.make_generator(p, device) for p in params])
    assert tokens[1] == again[1]
