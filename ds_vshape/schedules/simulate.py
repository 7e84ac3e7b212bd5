"""Timed simulation of a schedule: makespan, idle time, bubble rate and activation memory.

Each rank runs its actions in order; an action starts when its rank is free and every
prerequisite has finished (plus one communication latency when the prerequisite ran on
another rank). Memory is counted in M_B, the activation of one micro-batch for a 1/p slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import Costs
from .ir import Action, Kind, Schedule
from .validate import ScheduleError, event_of, prerequisites

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True)
class SimResult:
    """What one simulated step costs. ``timeline[r]`` holds (start, end, action) in rank order."""

    makespan: float
    busy: tuple[float, ...]
    peak_memory: tuple[float, ...]
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...]

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_rates(self) -> tuple[float, ...]:
        return tuple(i / self.makespan if self.makespan else 0.0 for i in self.idle)

    @property
    def bubble_rate(self) -> float:
        """Idle share of all rank-time in the step."""
        total = self.makespan * len(self.busy)
        return sum(self.idle) / total if total else 0.0

    @property
    def max_peak_memory(self) -> float:
        return max(self.peak_memory)


def simulate(schedule: Schedule, costs: Costs | None = None, *, kept_until_w: float | None = None) -> SimResult:
    """Run the schedule event by event.

    ``kept_until_w``: the share of a unit's activation that B keeps for its W (the inputs of
    the weight GEMMs); 0 frees everything at B, 1 keeps everything until W. None takes
    ``costs.w_memory``, the share the generators planned for.
    """
    costs = costs or Costs()
    if kept_until_w is None:
        kept_until_w = costs.w_memory
    if not 0.0 <= kept_until_w <= 1.0:
        raise ValueError(f"kept_until_w must be in [0, 1], got {kept_until_w}")
    finish, timeline = _run(schedule, costs)
    makespan = max((t[-1][1] for t in timeline if t), default=0.0)
    busy = tuple(sum(e - s for s, e, _ in t) for t in timeline)
    peaks = tuple(_peak_memory(schedule, actions, costs, kept_until_w) for actions in schedule.ranks)
    return SimResult(makespan, busy, peaks, tuple(tuple(t) for t in timeline))


def _run(schedule: Schedule, costs: Costs) -> tuple[dict, list[list[tuple[float, float, Action]]]]:
    S, k, v = schedule.num_model_stages, schedule.seq_chunks, schedule.chunks_per_rank
    finish: dict = {}  # event -> (end time, rank)
    clock = [0.0] * schedule.stages
    heads = [0] * schedule.stages
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(schedule.stages)]
    remaining = sum(len(a) for a in schedule.ranks)
    while remaining:
        progressed = 0
        for rank, actions in enumerate(schedule.ranks):
            while heads[rank] < len(actions):
                a = actions[heads[rank]]
                deps = prerequisites(a, num_model_stages=S, seq_chunks=k)
                if any(d not in finish for d in deps):
                    break
                ready = max((finish[d][0] + (costs.comm if finish[d][1] != rank else 0.0) for d in deps), default=0.0)
                start = max(clock[rank], ready)
                end = start + costs.duration(a, chunks_per_rank=v, seq_chunks=k)
                clock[rank] = end
                timeline[rank].append((start, end, a))
                ev = event_of(a)
                if ev is not None:
                    finish[ev] = (end, rank)
                heads[rank] += 1
                progressed += 1
        if not progressed:
            raise ScheduleError(schedule, "dependency", "the schedule deadlocks; run validate() for the exact place")
        remaining -= progressed
    return finish, timeline


def _peak_memory(schedule: Schedule, actions: tuple[Action, ...], costs: Costs, kept_until_w: float) -> float:
    v, k = schedule.chunks_per_rank, schedule.seq_chunks
    level = peak = 0.0
    for a in actions:
        share = costs.seq_share(a.seq_chunk, k) / v
        if a.kind is Kind.F:
            level += share
        elif a.kind is Kind.B:
            level -= share * (1.0 - kept_until_w)
        elif a.kind is Kind.W:
            level -= share * kept_until_w
        else:
            level -= share
        peak = max(peak, level)
    return peak
