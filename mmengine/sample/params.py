"""SamplingParams: what a request asks of the sampler (plain data, checked on construction)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from mmengine.errors import ConfigError
from mmengine.sample.structured_output.params import StructuredOutputParams

# Temperatures below this are treated as greedy: dividing logits by a smaller
# value can overflow float32 and turn the softmax into NaNs.
_GREEDY_EPS = 1e-5
_MAX_SEED = 2**64  # torch.Generator.manual_seed accepts seeds in [0, 2**64)
MAX_LOGPROBS = 64


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bad(name: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"SamplingParams.{name} must be {expected}, got {value!r}")


@dataclass
class SamplingParams:
    """How to pick the tokens of one request, and when to stop."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 means disabled; else >= 1
    # Per-request seed: same seed + same logits => same tokens, whatever else is in the batch.
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # a str is accepted and wrapped in a list
    ignore_eos: bool = False
    # Return each generated token's log-probability and the `logprobs` most likely alternatives (0: the
    # sampled token's only; None: none). Raw: log_softmax of the model's logits, before temperature,
    # top-k and top-p, as vLLM returns them by default.
    logprobs: int | None = None
    # Also return each prompt token's log-probability and the `prompt_logprobs` most likely tokens at
    # its position (the first token has none). Such a request computes its whole prompt: it does not
    # read the prefix cache, whose hits would skip the positions asked about (it still fills it).
    prompt_logprobs: int | None = None
    # The output must match a JSON schema, a regex, a choice or a grammar (see StructuredOutputParams).
    structured_output: StructuredOutputParams | None = None
    # mmengine/sample/penalties.py: OpenAI's presence and frequency penalties over the generated tokens, in
    # [-2, 2]; transformers' repetition penalty over prompt and generated tokens, > 0 (1: none).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Added to the token's logit before sampling (OpenAI's logit_bias: values in [-100, 100]).
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.max_tokens = self._check_max_tokens(self.max_tokens)
        self.temperature = self._check_temperature(self.temperature)
        self.top_p = self._check_top_p(self.top_p)
        self.top_k = self._check_top_k(self.top_k)
        self.seed = self._check_seed(self.seed)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)
        self.stop = self._check_stop(self.stop)
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "a bool")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _bad("logprobs", self.logprobs, f"None or an int in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise _bad("prompt_logprobs", self.prompt_logprobs, f"None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:  # also rejects NaN
                raise _bad(name, value, "a number in [-2, 2]")
            setattr(self, name, float(value))
        if not _is_real(self.repetition_penalty) or not (0 < self.repetition_penalty < math.inf):
            raise _bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        self.repetition_penalty = float(self.repetition_penalty)
        if not isinstance(self.logit_bias, dict) or not all(
            _is_int(t) and t >= 0 and _is_real(v) and -100 <= v <= 100 for t, v in self.logit_bias.items()
        ):
            raise _bad("logit_bias", self.logit_bias, "a dict of token ids >= 0 to numbers in [-100, 100]")
        self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputParams):
            raise _bad("structured_output", self.structured_output, "None or a StructuredOutputParams")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0, or too small to sample with)."""
        return self.temperature < _GREEDY_EPS

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @staticmethod
    def _check_max_tokens(value: object) -> int:
        if not _is_int(value) or value < 1:
            raise _bad("max_tokens", value, "an int >= 1")
        return int(value)

    @staticmethod
    def _check_temperature(value: object) -> float:
        if not _is_real(value) or not math.isfinite(value) or value < 0:
            raise _bad("temperature", value, "a finite number >= 0")
        return float(value)

    @staticmethod
    def _check_top_p(value: object) -> float:
        if not _is_real(value) or not (0 < value <= 1):  # also rejects NaN
            raise _bad("top_p", value, "a number in (0, 1]")
        return float(value)

    @staticmethod
    def _check_top_k(value: object) -> int:
        if not _is_int(value) or value < -1:
            raise _bad("top_k", value, "an int >= 1, or 0 / -1 to disable it")
        return int(value)

    @staticmethod
    def _check_seed(value: object) -> int | None:
        if value is None:
            return None
        if not _is_int(value) or not (0 <= value < _MAX_SEED):
            raise _bad("seed", value, "None or an int in [0, 2**64)")
        return int(value)

    @staticmethod
    def _check_stop_token_ids(value: object) -> list[int]:
        if not isinstance(value, (list, tuple)):
            raise _bad("stop_token_ids", value, "a list of ints >= 0")
        for token_id in value:
            if not _is_int(token_id) or token_id < 0:
                raise _bad("stop_token_ids", value, "a list of ints >= 0")
        return [int(token_id) for token_id in value]

    @staticmethod
    def _check_stop(value: object) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise _bad("stop", value, "a non-empty str or a list of non-empty strs")
        for stop in value:
            if not isinstance(stop, str) or not stop:
                raise _bad("stop", value, "a non-empty str or a list of non-empty strs")
        return list(value)
