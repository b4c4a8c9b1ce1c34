"""Log-probabilities in OpenAI's two formats: chat's `{"content": [{token, logprob, bytes,
top_logprobs}]}` and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.

The values are the engine's (SamplingParams.logprobs): log_softmax of the logits after a grammar's
mask and the penalties, before temperature, top-k and top-p. A token's text is its bytes decoded as
UTF-8, or `bytes:\\xNN...` when they are part of a character, as vLLM writes them. A token no grammar
allows has -inf, which JSON cannot hold: it is written as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from mmengine.outputs import TokenLogprobs

_FLOOR = -9999.0


def token_text(token_bytes: bytes) -> str:
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes)


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


class LogprobsFormatter:
    """Formats TokenLogprobs with `decode_bytes(token_id) -> bytes` (the tokenizer's own bytes)."""

    def __init__(self, decode_bytes: Callable[[int], bytes]) -> None:
        self._bytes = decode_bytes

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self._bytes(token_id)
        return {"token": token_text(raw), "logprob": _value(logprob), "bytes": list(raw)}

    def chat(self, entries: Sequence[TokenLogprobs], top: int) -> dict[str, Any]:
        return {"content": [{**self._entry(e.token_id, e.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in e.top[:top]]} for e in entries],
                "refusal": None}

    def completion(self, entries: Sequence[TokenLogprobs], top: int, text_offset: int = 0) -> dict[str, Any]:
        """`text_offset` is where the first of `entries` starts in the choice's text."""
        return self._completion([(e.token_id, e) for e in entries], top, text_offset)

    def echoed_completion(self, prompt_token_ids: Sequence[int], prompt_entries: Sequence[TokenLogprobs | None],
                          entries: Sequence[TokenLogprobs], top: int) -> dict[str, Any]:
        """`echo`: the prompt's tokens first, then the generated `entries`, text_offset counted from 0 over
        both (as vLLM does). A prompt token without an entry (the first: nothing predicts it) has a null
        logprob and null top_logprobs."""
        rows = [*zip(prompt_token_ids, prompt_entries, strict=True), *((e.token_id, e) for e in entries)]
        return self._completion(rows, top, 0)

    def _completion(self, rows: Sequence[tuple[int, TokenLogprobs | None]], top: int, text_offset: int) -> dict[str, Any]:
        tokens, offsets, values, tops = [], [], [], []
        for token_id, e in rows:
            text = token_text(self._bytes(token_id))
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
            if e is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_value(e.logprob))
            best = {token_text(self._bytes(t)): _value(v) for t, v in e.top[:top]}
            best.setdefault(text, _value(e.logprob))  # the sampled token is always listed, as vLLM does
            tops.append(best if top > 0 else None)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if top > 0 else None, "text_offset": offsets}


def cumulative_logprob(entries: Sequence[TokenLogprobs]) -> float:
    return sum(e.logprob for e in entries)


def prompt_logprobs_json(entries: Sequence[TokenLogprobs | None], decode_bytes: Callable[[int], bytes],
                         top: int | None = None) -> list[Any]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and the best k (rank: its place among those k, else None);
    `top`: the k shown, when the entries hold more (None: all they hold)."""
    result: list[Any] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        best = entry.top[:top]
        ranks = {token: rank for rank, (token, _) in enumerate(best, start=1)}
        tokens = {entry.token_id: entry.logprob, **dict(best)}
        result.append({str(token): {"logprob": _value(value), "rank": ranks.get(token),
                                    "decoded_token": token_text(decode_bytes(token))} for token, value in tokens.items()})
    return result
