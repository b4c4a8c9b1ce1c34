"""What the engine hands back to users."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """One generated token's raw log-probability and the most likely tokens at its position (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), SamplingParams.logprobs of them


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (a stop token is included, a stop string's tokens are kept)
    text: str  # generated text, ending before a matched stop string
    finish_reason: str | None  # "stop" | "length" | "abort", None while running
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, with SamplingParams(logprobs=k)
    # one per prompt token (None for the first), with SamplingParams(prompt_logprobs=k)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # with EngineConfig.reasoning_parser: the <think> part, and `text` is the answer after it
    reasoning_content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
