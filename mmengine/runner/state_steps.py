"""A hybrid model's recurrent states over one step: the scheduler's slot plan applied to the device's states.

It owns the step-time handling of the linear-attention layers' state slots (one GatedDeltaStates per layer, laid out
by the runner: live slots, draft slots, checkpoints, a scratch slot): each admitted request's live state started
(zeroed, or a checkpoint copied in), the step described to the layers (each request's slot and save offsets in packed
order; verify rows run token by token), a position saved twice (a checkpoint and a draft state) copied after the
forward, and the checkpoints a graph replay leaves to be copied. Which slot is which is the scheduler's (the
ScheduledRequest's state plan); this only applies it.
"""

from __future__ import annotations

from collections.abc import Iterable

from mmengine.core.scheduler import ScheduledRequest
from mmengine.layers.gated_delta import GatedDeltaStates, RecurrentStep
from mmengine.runner.verify_graphs import state_source


def copy_states(states: list[GatedDeltaStates], pairs: Iterable[tuple[int, int]]) -> None:
    """Copies slot `source` into slot `target` in every layer, for each (source, target)."""
    for source, target in pairs:
        for layer in states:
            layer.copy(source, target)


def start_states(states: list[GatedDeltaStates], scheduled: list[ScheduledRequest]) -> None:
    """Starts each admitted request's live state: zeros, or a checkpoint copied in."""
    for s in scheduled:
        plan = s.state
        if plan.reset or plan.restore_from is not None:
            for layer in states:
                if plan.reset:
                    layer.reset(plan.slot)
                else:
                    layer.copy(plan.restore_from, plan.slot)


def describe_step(scheduled: list[ScheduledRequest],
                  query_start_loc: list[int]) -> tuple[RecurrentStep, list[tuple[int, int]]]:
    """The step as the linear-attention layers see it (slots and saves in packed order), and the twin saves:
    (slot saved, slot that gets the same state) for each position saved twice, to copy after the forward."""
    saves, twins = [], []
    for s in scheduled:
        offsets: list[tuple[int, int]] = []
        for position, slot in sorted(s.state.saves + s.state.draft_saves):
            if offsets and offsets[-1][0] == position - s.start:  # a checkpoint and a draft state at one position
                twins.append((offsets[-1][1], slot))
            else:
                offsets.append((position - s.start, slot))
        saves.append(offsets)
    stepwise = frozenset(i for i, s in enumerate(scheduled) if s.state.draft_saves)  # verify steps: token by token
    step = RecurrentStep(query_start_loc[: len(scheduled) + 1], [s.state.slot for s in scheduled], saves, stepwise=stepwise)
    return step, twins


def decode_graph_saves(scheduled: list[ScheduledRequest]) -> list[tuple[int, int]]:
    """After a decode graph's replay: each checkpoint gets its request's live state (a decode saves after its one token)."""
    return [(s.state.slot, target) for s in scheduled for _, target in s.state.saves]


def verify_graph_saves(scheduled: list[ScheduledRequest]) -> list[tuple[int, int]]:
    """After a verify graph's replay: each checkpoint inside the step gets the state the graph kept at its position."""
    return [(state_source(s, position), target) for s in scheduled for position, target in s.state.saves]
