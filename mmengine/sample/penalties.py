"""Presence, frequency and repetition penalties (and logit_bias), applied on the device from per-request token counts
that stay on the device: a step's sampled tokens are added to their rows' counts where they were
sampled, so nothing is read back and the decode CUDA graphs (which end before sampling) are unchanged.
A verify row's position counts the drafts before it (its input tokens on the device); its request's kept
run is counted once known: with a draft head on the device, from the accepted count, else once booked.

OpenAI's rule for the generated tokens: logit[t] -= frequency_penalty * count[t] + presence_penalty *
(count[t] > 0). transformers' (and vLLM's) repetition penalty over the prompt and generated tokens:
a positive logit is divided by it, a negative one multiplied.
"""

from __future__ import annotations

import torch


class PenaltyState:
    """Device rows of output-token counts and prompt-token masks, one per penalized request in flight.
    Rows are taken on a request's first sampled step and given back when it finishes."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._rows: dict[str, int] = {}
        self._free: list[int] = []

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def row_of(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """The request's row, made on first use (counts zero, its prompt's tokens marked)."""
        row = self._rows.get(request_id)
        if row is not None:
            return row
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._rows[request_id] = row
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        if prompt_token_ids:
            ids = torch.tensor(prompt_token_ids, dtype=torch.long).clamp_(0, self.vocab_size - 1).to(self.device, non_blocking=True)
            self.in_prompt[row].index_fill_(0, ids, True)
        return row

    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], in_prompt[:old] = self.counts, self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))

    def apply(self, logits: torch.Tensor, batch_rows: torch.Tensor, state_rows: torch.Tensor, presence: torch.Tensor,
              frequency: torch.Tensor, repetition: torch.Tensor, extra_counts: torch.Tensor | None = None) -> torch.Tensor:
        """logits [n, vocab] with rows `batch_rows` penalized from state rows `state_rows`, by the
        per-row penalties given as float32 device tensors; a new tensor. `extra_counts` [rows, vocab]: tokens
        each row counts beyond its state's (a verify row's drafts before it)."""
        rows = logits.index_select(0, batch_rows).float()
        counts = self.counts.index_select(0, state_rows)
        if extra_counts is not None:
            counts = counts + extra_counts
        seen = self.in_prompt.index_select(0, state_rows) | (counts > 0)
        repetition = repetition.unsqueeze(1)
        rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
        rows = rows - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0)
        return logits.index_copy(0, batch_rows, rows.to(logits.dtype))

    def tokens_counted(self, num_rows: int, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[num_rows, vocab] counts of `tokens` [n], each in its row of `rows` [n] (on the device)."""
        counts = torch.zeros(num_rows, self.vocab_size, dtype=torch.int32, device=self.device)
        return counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def count(self, state_rows: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Adds each row's sampled token to its counts (on the device); `weights` [n] (0 or 1): which count."""
        one = torch.ones_like(tokens, dtype=torch.int32) if weights is None else weights.to(torch.int32)
        self.counts.index_put_((state_rows, tokens), one, accumulate=True)


def apply_logit_bias(logits: torch.Tensor, biases: list[tuple[int, dict[int, float]]]) -> torch.Tensor:
    """logits [n, vocab] plus each (row, {token: bias}); a new tensor."""
    rows = [row for row, bias in biases for _ in bias]
    tokens = [token for _, bias in biases for token in bias]
    values = [value for _, bias in biases for value in bias.values()]
    index = torch.tensor([rows, tokens], dtype=torch.long).to(logits.device, non_blocking=True)
    added = torch.tensor(values, dtype=logits.dtype).to(logits.device, non_blocking=True)
    return logits.index_put((index[0], index[1]), added, accumulate=True)
