"""The step loop's side of a draft head (MTP, EAGLE-3): the drafts the head made within the step just read.

The head drafts on the device right after each sampling step, at TP 1 in ModelRunner.sample and on every
tensor-parallel rank alike (runner/head_drafter.py), up to num_speculative_tokens a request and as far as the
request's blocks reach; the step's tokens and drafts come back in one read (rank 0's StepResult at TP > 1). Once
the step loop has booked the step, it hands each request the prefix it may take: fewer where the request is near
its end, the back-off pauses it, or a grammar stops them. A chain's first drafts do not depend on how long it runs,
so a prefix is what a shorter chain would have drafted.
"""

from __future__ import annotations


class HeadDrafts:
    def __init__(self) -> None:
        self.latest: dict[str, list[int]] = {}

    def received(self, drafts: dict[str, list[int]]) -> None:
        """The drafts of the step just read (request id -> drafts)."""
        self.latest = drafts

    def propose(self, wanted: dict[str, int]) -> dict[str, list[int]]:
        """Up to wanted[request_id] of each request's latest drafts (each set is handed out once)."""
        found, self.latest = self.latest, {}
        return {request_id: found[request_id][:n] for request_id, n in wanted.items() if n > 0 and found.get(request_id)}
