"""Verifying drafts against the target model's own samples, and what speculation did (the counters).

A verify step samples a token at every scheduled position (the last token's and each draft's) with the
request's own sampling settings. Draft j is accepted while every sample before it equalled its draft,
and the first sample that differs is emitted in its place (or, all accepted, the sample after the last
draft). For drafts that are single proposed tokens (n-gram lookup: no draft distribution), this is
exactly rejection sampling: draft d is accepted with probability p(d), and a rejection emits a token
drawn from p without d, renormalised. So every emitted token is distributed as without speculation,
and with greedy decoding the tokens are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def accepted_prefix(drafts: Sequence[int], samples: Sequence[int]) -> int:
    """How many drafts the target's samples accept: the length of their common prefix
    (samples[i] is the target's token at draft i's position)."""
    accepted = 0
    for draft, sample in zip(drafts, samples):
        if draft != sample:
            break
        accepted += 1
    return accepted


@dataclass
class SpecCounters:
    """Draft tokens verified and accepted, overall and by draft position (0: the first draft)."""

    num_speculative_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # request-steps that verified at least one draft
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_by_position = [0] * self.num_speculative_tokens
        self.drafted_by_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.verify_steps += 1
        for position in range(num_drafts):
            self.drafted_by_position[position] += 1
            if position < num_accepted:
                self.accepted_by_position[position] += 1

    def stats(self) -> dict[str, int]:
        found = {"spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                 "spec_verify_steps": self.verify_steps}
        for position in range(self.num_speculative_tokens):
            found[f"spec_drafted_position_{position}"] = self.drafted_by_position[position]
            found[f"spec_accepted_position_{position}"] = self.accepted_by_position[position]
        return found
