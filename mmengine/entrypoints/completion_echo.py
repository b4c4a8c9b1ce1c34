"""`echo` on /v1/completions: each choice's text and logprobs start with its prompt's, in OpenAI's legacy
format and as vLLM writes them. lm-eval's `local-completions` scores every loglikelihood request this way
(`echo=True, logprobs=1, max_tokens=1, temperature=0`, reading `token_logprobs[ctxlen:-1]`).

- text: the prompt as given (a token-id prompt decoded, special tokens kept), then the generated text;
- logprobs (`logprobs=N`): the prompt's tokens first, then the generated ones. The first prompt token has a
  null logprob and null top_logprobs (nothing predicts it); every other one its log-probability given the
  tokens before it and the N most likely tokens there (the engine's prompt logprobs: raw log_softmax of the
  model's logits). text_offset counts the tokens' text from 0 over both;
- `max_tokens: 0`: the prompt alone. The engine computes one token (it generates at least one), which the
  answer drops: no generated text or logprobs, completion_tokens 0, finish_reason "length".

Streamed, each choice's first chunk carries the prompt. Not served (a 400 naming the field): echo with
logprobs and stream (the prompt's logprobs come with the whole answer), echo with use_beam_search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mmengine.engine.async_engine import DeltaOutput


@dataclass(frozen=True)
class Echo:
    texts: Sequence[str]  # each prompt's text, in the request's order

    @staticmethod
    def of(prompts: Sequence[str | dict[str, Any]], decode: Callable[[list[int]], str]) -> Echo:
        """`prompts` as the engine takes them: a str, or {"prompt_token_ids": [...]} (decoded)."""
        return Echo([p if isinstance(p, str) else decode(p["prompt_token_ids"]) for p in prompts])


async def prompt_only(deltas: AsyncIterator[DeltaOutput]) -> AsyncIterator[DeltaOutput]:
    """A request's deltas with what it generated taken out (echo with max_tokens 0)."""
    async for delta in deltas:
        yield dataclasses.replace(
            delta, text="", token_ids=[], logprobs=[] if delta.logprobs is not None else None, num_output_tokens=0,
            reasoning_text="", finish_reason="length" if delta.finished else None, stop_reason=None,
        )
