"""NgramProposer: drafts from the request's own history (prompt lookup decoding).

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked for earlier in the
request's tokens, prompt and output; the latest earlier occurrence proposes the tokens that followed it.
Repetitive output (code, JSON, quoting the prompt, a model looping) is where it pays; elsewhere it
proposes nothing and the step is a plain decode. Each request's tokens are kept in a NumPy array that
grows with its output, so a step converts only the tokens it added.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_drafts(tokens: np.ndarray, k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` (from
    prompt_lookup_max down to prompt_lookup_min tokens long) that occurs earlier; [] when none does."""
    num_tokens = len(tokens)
    if k <= 0 or num_tokens < prompt_lookup_min + 1:
        return []
    for n in range(min(prompt_lookup_max, num_tokens - 1), prompt_lookup_min - 1, -1):
        # windows start at 0 .. num_tokens - 1 - n: each has a token after it, and the suffix itself is not one
        windows = sliding_window_view(tokens[: num_tokens - 1], n)
        matches = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._histories: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) draft tokens to follow the request's `token_ids`."""
        k = min(self.num_speculative_tokens, max_drafts)
        if k <= 0:
            return []
        return ngram_drafts(self._history(request_id, token_ids), k, self.prompt_lookup_min, self.prompt_lookup_max)

    def forget(self, request_id: str) -> None:
        self._histories.pop(request_id, None)

    def _history(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        buffer, length = self._histories.get(request_id, (None, 0))
        if buffer is None or length > len(token_ids):  # new, or shorter than before: start again
            buffer, length = np.empty(max(64, 2 * len(token_ids)), dtype=np.int64), 0
        if len(token_ids) > len(buffer):
            grown = np.empty(2 * len(token_ids), dtype=np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length : len(token_ids)] = token_ids[length:]
        self._histories[request_id] = (buffer, len(token_ids))
        return buffer[: len(token_ids)]
