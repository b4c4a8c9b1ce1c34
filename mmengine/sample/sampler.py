"""The batched next-token sampler: per-row settings as tensors, greedy / top-k / top-p sampling, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmengine.sample.params import SamplingParams

@dataclass
class SamplingTensors:
    """Per-row sampling settings as device tensors (built from pinned host buffers by the runner,
    so making them never waits for the GPU). Greedy rows carry temperature 1 and no top-k/top-p."""

    greedy: torch.Tensor  # [rows] bool
    temperature: torch.Tensor  # [rows] float32
    top_k: torch.Tensor  # [rows] int64, vocab size when disabled
    top_p: torch.Tensor  # [rows] float32

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> SamplingTensors:
        host = sampling_rows(params, vocab_size)
        return cls(*(torch.from_numpy(column).to(device) for column in host))


def sampling_rows(params: list[SamplingParams], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Host columns (greedy, temperature, top_k, top_p) of SamplingTensors."""
    greedy = np.array([p.greedy for p in params], dtype=np.bool_)
    temperature = np.array([1.0 if p.greedy else p.temperature for p in params], dtype=np.float32)
    top_k = np.array([min(p.top_k, vocab_size) if p.top_k_enabled and not p.greedy else vocab_size for p in params], dtype=np.int64)
    top_p = np.array([1.0 if p.greedy else p.top_p for p in params], dtype=np.float32)
    return greedy, temperature, top_k, top_p


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled tokens' raw log-probabilities [rows] and the `top` most likely tokens' ids and
    log-probabilities [rows, top] (descending), from logits [rows, vocab]; all on the logits' device."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.view(-1, 1)).view(-1)
    values, ids = logprobs.topk(top, dim=-1) if top > 0 else (logprobs[:, :0], tokens.view(-1, 1)[:, :0])
    return chosen, ids, values


class Sampler:
    """Picks the next token of every request in a batch from its logits, on the logits' device
    and without reading anything back: the caller reads the tokens once."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        # One generator per device, for the random rows that have no seed of their own.
        self._generators: dict[torch.device, torch.Generator] = {}

    def make_generator(self, params: SamplingParams, device: torch.device) -> torch.Generator | None:
        """A per-request generator for seeded random sampling, None otherwise (greedy or unseeded)."""
        if params.greedy or params.seed is None:
            return None
        generator = torch.Generator(device=torch.device(device))
        generator.manual_seed(params.seed)
        return generator

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        tensors: SamplingTensors | None = None,
    ) -> torch.Tensor:
        """logits [num_reqs, vocab] (any float dtype, any device) -> next token ids [num_reqs] int64 on the same device.
        `tensors` are the rows' settings on the device (made from `params` when not given)."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"logits {tuple(logits.shape)}, {len(params)} params and {len(generators)} generators do not match"
            )
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_tokens
        if tensors is None:
            tensors = SamplingTensors.from_params(params, logits.shape[1], logits.device)
        probs = _probs(logits.float(), tensors, filtered=any(p.top_k_enabled or p.top_p < 1.0 for p in params))
        noise = self._exponential_noise(probs, generators)
        return torch.where(tensors.greedy, greedy_tokens, (probs / noise).argmax(dim=-1))

    def _default_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """q ~ Exp(1) per row: each seeded row from its own generator, the rest from the sampler's."""
        noise = torch.empty_like(probs).exponential_(generator=self._default_generator(probs.device))
        for i, generator in enumerate(generators):
            if generator is not None:
                # A fresh tensor per row, so the draws cannot depend on where the row sits.
                noise[i] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=generator)
        # A draw of exactly 0 would give inf (or NaN for a masked token) and win the race.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _probs(logits: torch.Tensor, tensors: SamplingTensors, filtered: bool) -> torch.Tensor:
    """Temperature-scaled, top-k/top-p-masked probabilities (float32)."""
    logits = logits / tensors.temperature.unsqueeze(1)
    if filtered:
        logits = logits.masked_fill(_top_k_top_p_mask(logits, tensors), float("-inf"))
    return logits.softmax(dim=-1)


def _top_k_top_p_mask(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """True for the tokens that top-k or top-p removes."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    removed = rank >= tensors.top_k.unsqueeze(1)

    probs = sorted_logits.masked_fill(removed, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A token goes once the tokens above it already reach top_p (so the top token, with
    # nothing above it, always stays); rows with top_p == 1 keep everything, as rounding
    # in the cumsum could otherwise drop a tail token.
    top_p = tensors.top_p.unsqueeze(1)
    removed |= (mass_before >= top_p) & (top_p < 1.0)
    return torch.zeros_like(removed).scatter_(1, order, removed)
