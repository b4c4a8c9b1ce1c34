"""NgramProposer: drafts from the request's own history (prompt lookup decoding).

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked for earlier in the
request's tokens, prompt and output; the latest earlier occurrence proposes the tokens that followed it.
Repetitive output (code, JSON, quoting the prompt, a model looping) is where it pays; elsewhere it
proposes nothing and the step is a plain decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) draft tokens to follow `token_ids`; [] when the
        suffix occurs nowhere earlier."""
        k = self.num_speculative_tokens if max_drafts is None else min(self.num_speculative_tokens, max_drafts)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens < self.prompt_lookup_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            # windows start at 0 .. num_tokens - 1 - n: each has a token after it, and the suffix itself is not one
            windows = sliding_window_view(tokens[: num_tokens - 1], n)
            matches = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start : start + k].tolist()
        return []
