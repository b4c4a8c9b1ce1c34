"""Beam search above the engine: each step, every live beam of every prompt is one request for one
token with the top 2 x width log-probabilities; the best `beam_width` continuations go on.

Beams are requests whose prompt is the prompt's expanded ids plus the beam's tokens, with the prompt's
items: the prompt is preprocessed once, its pictures encoded once (the encoder cache), and its KV
blocks shared by every beam through the prefix cache; each step computes only what a beam added
since its last full block. The scheduler and the caches know nothing of beams.

Selection follows transformers' beam search (`num_beams=W`, `early_stopping=False`): candidates are
ranked by cumulative log-probability; one ending in EOS among the best W becomes a finished hypothesis
scored `cum_logprob / generated_len ** length_penalty` (its length with the EOS); a prompt is done
when W hypotheses are finished and no live beam can beat the worst of them, or at max_tokens, when
the live beams join the hypotheses. Sequences come back best first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mmengine.core.request import ProcessedPrompt
from mmengine.engine.intake import RequestIntake
from mmengine.errors import ConfigError
from mmengine.models.family import ModelFamily
from mmengine.outputs import RequestOutput
from mmengine.sample.params import MAX_LOGPROBS, SamplingParams


class BeamSearchHost(Protocol):
    """What beam search uses of the engine (MMEngine's public attributes and methods)."""

    intake: RequestIntake
    family: ModelFamily
    tokenizer: Any
    eos_token_ids: frozenset[int]

    def run_processed(self, processed: Sequence[ProcessedPrompt], params_list: Sequence[SamplingParams],
                      salts: Sequence[str | None] | None = None, lora_keys: Sequence[str | None] | None = None,
                      use_tqdm: bool = False) -> list[RequestOutput]: ...


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ConfigError(f"BeamSearchParams.beam_width must be an int in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"BeamSearchParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, int | float) or not math.isfinite(self.length_penalty):
            raise ConfigError(f"BeamSearchParams.length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated (an EOS that ended it included)
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty
    text: str = ""


@dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first


@dataclass
class _Beam:
    tokens: list[int]
    cum_logprob: float


@dataclass
class _PromptSearch:
    """One prompt's beams and finished hypotheses."""

    processed: ProcessedPrompt
    beams: list[_Beam] = field(default_factory=lambda: [_Beam([], 0.0)])
    finished: list[BeamSequence] = field(default_factory=list)
    done: bool = False


def beam_search(
    engine: BeamSearchHost, prompts: Any, params: BeamSearchParams, images: Any = None, use_tqdm: bool = False
) -> list[BeamSearchOutput]:
    """Beam search for one prompt or a batch (prompts and images as generate() takes them)."""
    if not isinstance(params, BeamSearchParams):
        raise ConfigError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    checked = engine.intake.check_batch(prompts, images, SamplingParams(max_tokens=params.max_tokens))
    width = params.beam_width
    step_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * width)
    searches = [_PromptSearch(prepared.processed) for prepared in engine.intake.prepare_batch(checked)]
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    for length in range(params.max_tokens):
        live = [(search, beam) for search in searches if not search.done for beam in search.beams]
        if not live:
            break
        outputs = engine.run_processed([_extended(engine, search.processed, beam.tokens) for search, beam in live],
                                       [step_params] * len(live), use_tqdm=use_tqdm)
        candidates: dict[int, list[tuple[float, int, _Beam]]] = {}
        for (search, beam), output in zip(live, outputs):
            for token, logprob in output.logprobs[0].top:
                candidates.setdefault(id(search), []).append((beam.cum_logprob + logprob, token, beam))
        for search in searches:
            if not search.done:
                _advance(search, sorted(candidates[id(search)], key=lambda c: -c[0]), width, length, eos, params.length_penalty)
    for search in searches:  # at max_tokens: the live beams join the hypotheses
        if not search.done:
            for beam in search.beams:
                _add_hypothesis(search, beam.tokens, beam.cum_logprob, len(beam.tokens), width, params.length_penalty)
    return [
        BeamSearchOutput(search.processed.prompt, search.processed.prompt_token_ids,
                         [_with_text(engine, seq) for seq in sorted(search.finished, key=lambda s: -s.score)[:width]])
        for search in searches
    ]


def _extended(engine: BeamSearchHost, processed: ProcessedPrompt, tokens: list[int]) -> ProcessedPrompt:
    """The prompt with a beam's tokens appended (same items; positions over the whole sequence)."""
    if not tokens:
        return processed
    ids = processed.prompt_token_ids + tokens
    positions = engine.family.prompt_positions(ids, processed.mm_items)
    return ProcessedPrompt(processed.prompt, ids, processed.mm_items, positions)


def _advance(search: _PromptSearch, ranked: Sequence[tuple[float, int, _Beam]], width: int, length: int, eos: set[int],
             length_penalty: float) -> None:
    beams: list[_Beam] = []
    for rank, (cum, token, beam) in enumerate(ranked):
        if token in eos:
            if rank < width:  # as transformers: an EOS among the best W finishes a hypothesis
                _add_hypothesis(search, beam.tokens + [token], cum, length + 1, width, length_penalty)
            continue
        beams.append(_Beam(beam.tokens + [token], cum))
        if len(beams) == width:
            break
    search.beams = beams
    if len(search.finished) >= width:  # done when no live beam can beat the worst finished hypothesis
        best_live = max(beam.cum_logprob for beam in beams) / (length + 1) ** length_penalty if beams else -math.inf
        search.done = min(s.score for s in search.finished) >= best_live


def _add_hypothesis(search: _PromptSearch, tokens: list[int], cum: float, generated_len: int, width: int,
                    length_penalty: float) -> None:
    score = cum / max(generated_len, 1) ** length_penalty
    search.finished.append(BeamSequence(tokens, cum, score))
    if len(search.finished) > width:
        search.finished.remove(min(search.finished, key=lambda s: s.score))


def _with_text(engine: BeamSearchHost, seq: BeamSequence) -> BeamSequence:
    seq.text = engine.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
    return seq
