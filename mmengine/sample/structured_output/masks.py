"""The next step's allowed tokens: one bitmask row per constrained request, filled on the host
(llguidance, in parallel across rows) into pinned memory, and applied to the logits on the device.

A row is ceil(vocab / 32) int32 words; bit j of word i allows token 32 i + j.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmengine.sample.reasoning import ReasoningGate


class BitmaskFiller:
    """Fills the bitmask rows of a step's constrained requests; their matchers must have consumed
    every token sampled so far."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        pin = device.type == "cuda"
        self._host = torch.empty((max_rows, self.words), dtype=torch.int32, pin_memory=pin)
        self._executor = None
        self.num_masks = 0  # rows filled

    def fill(self, matchers: list[Any], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """[len(matchers), words] host bitmask; a matcher that is done (stopped or failed) allows
        every token, as its request's token is discarded, and so does one still waiting for its request's
        reasoning to end (a gate's opening token is allowed besides its grammar's). `drafts[row]`: draft
        tokens (speculative decoding, allowed by the grammar) the row's position comes after: its row is
        the grammar's mask after them, and the matcher is rolled back."""
        if drafts is not None and any(drafts):
            return self._fill_after_drafts(matchers, drafts)
        import llguidance
        import llguidance.numpy

        host = self._host[: len(matchers)]
        array = host.numpy()
        live = []
        openings = []  # (row, token) allowed besides the grammar's tokens
        for row, matcher in enumerate(matchers):
            if matcher is None:  # filled by the caller (_fill_after_drafts)
                continue
            if isinstance(matcher, ReasoningGate):  # a grammar that applies after the reasoning (sample/reasoning.py)
                if matcher.waiting:
                    array[row] = -1
                    continue
                if matcher.opening_token is not None and matcher.opening_token < self.vocab_size:
                    openings.append((row, matcher.opening_token))
                matcher = matcher.matcher
            if matcher.is_error() or matcher.is_stopped():
                array[row] = -1
            else:
                live.append((matcher, row))
        if len(live) == 1:
            llguidance.numpy.fill_next_token_bitmask(live[0][0], array, live[0][1])
        elif live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, live, array)
        bits = array.view(np.uint32)
        for row, token in openings:
            bits[row, token // 32] |= np.uint32(1 << (token % 32))
        self.num_masks += len(matchers)
        return host


    def _fill_after_drafts(self, matchers: list[Any], drafts: list[list[int]]) -> torch.Tensor:
        """fill(), then each row that follows drafts filled again on its own: consume, fill, roll back."""
        import llguidance.numpy

        host = self.fill([None if before else matcher for matcher, before in zip(matchers, drafts)])
        array = host.numpy()
        for row, before in enumerate(drafts):
            if before:
                matcher = matchers[row]
                if not matcher.consume_tokens(before):  # the proposer keeps only drafts the grammar allows
                    raise RuntimeError(f"a draft the grammar does not allow reached the masks: {before}")
                llguidance.numpy.fill_next_token_bitmask(matcher, array, row)
                matcher.rollback(len(before))
        return host


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] with the tokens that `bitmask` [len(rows), words] (on the logits' device)
    forbids in rows `rows` set to -inf; a new tensor, `logits` is left as it was."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made on the device: no copy to wait for
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)
