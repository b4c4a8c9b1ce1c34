"""What the step loop asks of a draft proposer (NgramProposer; tests and benchmarks bring their own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens to follow `token_ids` (the request's prompt and output so far)."""

    def forget(self, request_id: str) -> None:
        """The request left: whatever is kept for it goes."""
