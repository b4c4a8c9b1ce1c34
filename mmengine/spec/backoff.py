"""Per-request back-off: a proposer whose drafts a request keeps rejecting stops drafting for it a while.

A verify step whose drafts were all rejected cost more than the decode it replaced (the drafts' positions
were computed and sampled for nothing). After `patience` such steps in a row, the request decodes without
drafts for a pause of decode steps that doubles with each pause in a row (first_pause, 2 x, ... up to
max_pause); a verify step that keeps any draft ends the streak and the doubling. The drafts never change a
token, so neither does this: it only moves work between verify steps and plain decodes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Streak:
    misses: int = 0  # verify steps in a row that kept no draft
    pauses: int = 0  # pauses in a row (the next one is first_pause << pauses)
    paused_for: int = 0  # decode steps left without drafts


class DraftBackoff:
    def __init__(self, patience: int = 2, first_pause: int = 2, max_pause: int = 32) -> None:
        self.patience, self.first_pause, self.max_pause = patience, first_pause, max_pause
        self._streaks: dict[str, _Streak] = {}
        self.num_paused_steps = 0  # decode steps a request made without drafts because of a pause

    def record(self, request_id: str, num_accepted: int) -> None:
        """A verify step's outcome for the request: how many of its drafts were kept."""
        streak = self._streaks.setdefault(request_id, _Streak())
        if num_accepted > 0:
            streak.misses = streak.pauses = 0
            return
        streak.misses += 1
        if streak.misses >= self.patience:
            streak.paused_for = min(self.first_pause << streak.pauses, self.max_pause)
            streak.pauses += 1
            streak.misses = 0

    def allows(self, request_id: str) -> bool:
        """Whether the request drafts for its next step (asked once per decode step; a pause counts down)."""
        streak = self._streaks.get(request_id)
        if streak is None or streak.paused_for == 0:
            return True
        streak.paused_for -= 1
        self.num_paused_steps += 1
        return False

    def paused(self, request_id: str) -> bool:
        """Whether the request's next ask is surely refused (a pause under way), without counting an ask: a
        verify step's outcome can start a pause, never end one."""
        streak = self._streaks.get(request_id)
        return streak is not None and streak.paused_for > 0

    def forget(self, request_id: str) -> None:
        self._streaks.pop(request_id, None)
