"""A launched step: its kernels are queued on the device and its sampled tokens are read back later.

Async scheduling launches step N+1 before reading step N's tokens: N's tokens stay on the device,
where N+1's inputs take them, and a non-blocking copy brings them to pinned host memory for the
scheduler. Reading them is the step's one wait for the device. A draft head's drafts, made within the
step (runner/head_drafter.py), come back in the same copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmengine.outputs import TokenLogprobs
from mmengine.runner.head_drafter import DeviceDrafts


@dataclass
class PromptLogprobs:
    """One request's prompt log-probabilities from one step's chunk (device tensors)."""

    request: Any  # the Request (its prompt_logprobs are filled in when the step is read)
    first_position: int  # the prompt position of the first token here
    tokens: torch.Tensor  # [n] the prompt tokens at first_position, first_position + 1, ...
    chosen: torch.Tensor  # [n] their log-probabilities
    top_ids: torch.Tensor  # [n, k]
    top_values: torch.Tensor  # [n, k]
    k: int

    def entries(self) -> list[TokenLogprobs]:
        return [TokenLogprobs(token, value, list(zip(ids, values)))
                for token, value, ids, values in zip(self.tokens.tolist(), self.chosen.tolist(), self.top_ids.tolist(),
                                                     self.top_values.tolist())]


@dataclass
class PendingSample:
    """A step's logits, waiting for its grammar masks before they are sampled."""

    logits: torch.Tensor  # [len(sampled), vocab] on the device
    sampled: list[Any]  # the ScheduledRequests whose rows these are
    sampling: Any  # their SamplingTensors (None when all are greedy)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # [len(sampled)] each row's input token on the device (a verify row's: its drafts, as the device verified them),
    # when a penalized row verifies drafts (None otherwise)
    input_ids: torch.Tensor | None = None


@dataclass
class LaunchedStep:
    sampled_ids: list[str]  # request ids, in the order of `tokens`
    tokens: torch.Tensor | None  # [len(sampled_ids)] int64 on the device
    host: torch.Tensor | None  # their host copy, complete once `ready` has passed
    ready: torch.cuda.Event | None  # None on CPU, where the copy is the tensor itself
    # For the rows that asked for log-probabilities: (row indices, chosen [n], top ids [n, k], top values [n, k], k per row)
    logprobs: tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None = None
    pending: PendingSample | None = None  # set while the forward is queued and sampling waits for masks
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # A draft head's: the sampling requests' ids and how many drafts each has, read from `host` after the tokens
    draft_ids: list[str] = field(default_factory=list)
    num_drafts: int = 0
    device_drafts: DeviceDrafts | None = None  # the same on the device, which a step launched before the read follows

    def result(self) -> dict[str, list[int]]:
        """Waits for the step and returns each sampling request's tokens: one, or (a verify step) one per
        position it computed, in order."""
        if not self.sampled_ids:
            return {}
        assert self.pending is None, "the step's sampling is still pending: ModelRunner.sample() it first"
        if self.ready is not None:
            self.ready.synchronize()
        found: dict[str, list[int]] = {}
        for request_id, token in zip(self.sampled_ids, self.host.tolist()):
            found.setdefault(request_id, []).append(token)
        return found

    def drafts(self, raw: bool = False) -> dict[str, list[int]]:
        """A draft head's drafts for each sampling request (after result()), as many as it computed within the
        request's blocks (`raw`: all the chain's, as a step launched before the read took them)."""
        if not self.draft_ids:
            return {}
        n, k, values = len(self.sampled_ids), self.num_drafts, self.host.tolist()
        counts = [k] * len(self.draft_ids) if raw else values[n + len(self.draft_ids) * k : n + len(self.draft_ids) * (k + 1)]
        return {request_id: values[n + r * k : n + r * k + count] for r, (request_id, count) in enumerate(zip(self.draft_ids, counts))}

    def token_logprobs(self) -> dict[str, list[TokenLogprobs]]:
        """The log-probabilities of the rows that asked for them (after result()), by request, in row order."""
        if self.logprobs is None:
            return {}
        rows, chosen, ids, values, ks = self.logprobs
        tokens = self.host.tolist()
        chosen, ids, values = chosen.tolist(), ids.tolist(), values.tolist()
        found: dict[str, list[TokenLogprobs]] = {}
        for i, (row, k) in enumerate(zip(rows, ks)):
            entry = TokenLogprobs(tokens[row], chosen[i], list(zip(ids[i][:k], values[i][:k])))
            found.setdefault(self.sampled_ids[row], []).append(entry)
        return found

    def token_rows(self) -> dict[str, int]:
        """Request id -> index of its token in `tokens`."""
        return {request_id: index for index, request_id in enumerate(self.sampled_ids)}


NOTHING_SAMPLED = LaunchedStep([], None, None, None)


class TokenReadback:
    """Starts the copy of a step's sampled tokens to the host without waiting for them. Two pinned
    buffers take turns: a step's tokens are read while the next step, which fills the other, runs."""

    def __init__(self, max_reqs: int, device: torch.device) -> None:
        self._host = []
        if device.type == "cuda":
            self._host = [torch.empty(max_reqs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._turn = 0

    def start(self, sampled_ids: list[str], tokens: torch.Tensor, drafts: DeviceDrafts | None = None) -> LaunchedStep:
        values = tokens
        if drafts is not None:  # one copy: the tokens, then the drafts row by row, then their counts
            values = torch.cat([tokens, drafts.drafts.flatten(), drafts.counts])
        if not self._host:
            launched = LaunchedStep(sampled_ids, tokens, values, None)
        else:
            host = self._host[self._turn][: len(values)]
            self._turn ^= 1
            host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            launched = LaunchedStep(sampled_ids, tokens, host, ready)
        if drafts is not None:
            launched.draft_ids, launched.num_drafts = drafts.request_ids, drafts.drafts.shape[1]
            launched.device_drafts = drafts
        return launched
