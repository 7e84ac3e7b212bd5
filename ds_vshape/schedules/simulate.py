"""Timed simulation of a schedule: makespan, idle time, bubble rate and activation memory.

Each rank runs its actions in order; an action starts when its rank is free and every
prerequisite has finished (plus one communication latency when the prerequisite ran on
another rank). Memory is counted in M_B, the activation of one micro-batch for a 1/p slice.

With activation offload (``offload``: a share, planned by ``schedules.offload``) each rank
has two copy streams: an offloaded unit's activation goes to host after its forward (device
to host, ``costs.copy`` per M_B), comes back from the start of its planned reload pass (host
to device) and its backward waits until it is back. Memory counts it on the device during
its forward and from its reload on, in host memory in between (``peak_host_memory``). What
B keeps of such a unit for its W (``kept_until_w``) goes to host after B and comes back from
its planned W reload pass on, where the plan says so (``OffloadPlan.w_reload_at``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .costs import Costs
from .ir import Action, Kind, Schedule
from .offload import OffloadPlan, offload_plan
from .validate import ScheduleError, event_of, prerequisites

__all__ = ["SimResult", "simulate", "memory_peaks"]


@dataclass(frozen=True)
class SimResult:
    """What one simulated step costs. ``timeline[r]`` holds (start, end, action) in rank order."""

    makespan: float
    busy: tuple[float, ...]
    peak_memory: tuple[float, ...]
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...]
    peak_host_memory: tuple[float, ...] = ()  # offloaded activation in host memory (M_B), per rank

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


def simulate(schedule: Schedule, costs: Costs | None = None, *, kept_until_w: float | None = None,
             offload: float = 0.0) -> SimResult:
    """Run the schedule event by event.

    ``kept_until_w``: the share of a unit's activation that B keeps for its W (the inputs of
    the weight GEMMs); 0 frees everything at B, 1 keeps everything until W. None takes
    ``costs.w_memory``, the share the generators planned for. ``offload``: the share of each
    rank's activation offloaded to host (module doc), with what B keeps of it for W.
    """
    costs = costs or Costs()
    if kept_until_w is None:
        kept_until_w = costs.w_memory
    if not 0.0 <= kept_until_w <= 1.0:
        raise ValueError(f"kept_until_w must be in [0, 1], got {kept_until_w}")
    plans = [offload_plan(schedule, r, offload, costs=costs) for r in range(schedule.stages)] if offload > 0 else None
    finish, timeline = _run(schedule, costs, plans, kept_until_w=kept_until_w)
    makespan = max((t[-1][1] for t in timeline if t), default=0.0)
    busy = tuple(sum(e - s for s, e, _ in t) for t in timeline)
    v, k = schedule.chunks_per_rank, schedule.seq_chunks
    weight = lambda a: costs.seq_share(a.seq_chunk, k) / v  # noqa: E731
    levels = [memory_peaks(actions, weight, kept_until_w=kept_until_w, plan=plans[r] if plans else None)
              for r, actions in enumerate(schedule.ranks)]
    return SimResult(makespan, busy, tuple(d for d, _ in levels), tuple(tuple(t) for t in timeline),
                     tuple(h for _, h in levels))


def _run(schedule: Schedule, costs: Costs, plans: list[OffloadPlan] | None = None, *, kept_until_w: float = 0.0
         ) -> tuple[dict, list[list[tuple[float, float, Action]]]]:
    S, k, v = schedule.num_model_stages, schedule.seq_chunks, schedule.chunks_per_rank
    finish: dict = {}  # event -> (end time, rank)
    clock = [0.0] * schedule.stages
    heads = [0] * schedule.stages
    copies = [_Copies() for _ in range(schedule.stages)]
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
                copy = lambda u: _copy_time(costs, u, k, v)  # noqa: E731
                if plans is not None:
                    start = copies[rank].before(plans[rank], heads[rank], a, start, copy, kept_until_w=kept_until_w)
                end = start + costs.duration(a, chunks_per_rank=v, seq_chunks=k)
                if plans is not None and a.kind is Kind.F and a.unit in plans[rank].units:
                    copies[rank].offload(a.unit, end, copy(a.unit))
                elif plans is not None and a.kind is Kind.B and a.unit in plans[rank].w_units:
                    copies[rank].offload((Kind.W, a.unit), end, copy(a.unit) * kept_until_w)
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


def _copy_time(costs: Costs, unit: tuple[int, int, int], k: int, v: int) -> float:
    return costs.copy * costs.seq_share(unit[2], k) / v


class _Copies:
    """One rank's two copy streams: each copy starts when its stream is free and its data is there."""

    def __init__(self) -> None:
        self.d2h_free = self.h2d_free = 0.0
        # unit (its saved activation) or (Kind.W, unit) (what B kept of it for W) -> when the copy completed
        self.on_host: dict[Any, float] = {}
        self.back: dict[Any, float] = {}

    def offload(self, key: Any, after: float, duration: float) -> None:
        self.d2h_free = self.on_host[key] = max(after, self.d2h_free) + duration

    def before(self, plan: OffloadPlan, pos: int, action: Action, start: float, duration: Callable, *,
               kept_until_w: float) -> float:
        """Start the reloads planned at ``pos``; the start of ``action`` once what it needs is back."""
        for unit in plan.reload_at.get(pos, ()):
            self._reload(unit, start, duration(unit))
        for unit in plan.w_reload_at.get(pos, ()):
            self._reload((Kind.W, unit), start, duration(unit) * kept_until_w)
        if action.kind is Kind.W and action.unit in plan.w_units:
            return max(start, self.back[(Kind.W, action.unit)])
        if action.kind.is_backward and action.kind is not Kind.W and action.unit in plan.units:
            return max(start, self.back[action.unit])
        return start

    def _reload(self, key: Any, start: float, duration: float) -> None:
        self.h2d_free = self.back[key] = max(start, self.h2d_free, self.on_host[key]) + duration


def memory_peaks(actions: Sequence[Action], weight: Callable[[Action], float], *, kept_until_w: float,
                 plan: OffloadPlan | None = None) -> tuple[float, float]:
    """(device peak, host peak) of one rank's activation, each unit weighing ``weight(its F)``.

    An offloaded unit counts on the device during its forward and from the start of its reload
    pass on, on the host in between; B frees all but ``kept_until_w`` of a unit, W the rest.
    What B keeps for W of a unit in ``plan.w_units`` is on the host from B's end to the start
    of its W reload pass.
    """
    level = host = peak = host_peak = 0.0
    for pos, a in enumerate(actions):
        for unit, part in _reloads(plan, pos, kept_until_w):
            moved = weight(Action(Kind.F, *unit)) * part
            level, host = level + moved, host - moved
        peak = max(peak, level)
        share = weight(a)
        if a.kind is Kind.F:
            level += share
            peak = max(peak, level)
            if plan is not None and a.unit in plan.units:
                level, host = level - share, host + share
                host_peak = max(host_peak, host)
        elif a.kind is Kind.B:
            level -= share * (1.0 - kept_until_w)
            if plan is not None and a.unit in plan.w_units:
                level, host = level - share * kept_until_w, host + share * kept_until_w
                host_peak = max(host_peak, host)
        elif a.kind is Kind.W:
            level -= share * kept_until_w
        else:
            level -= share
        peak = max(peak, level)
    return peak, host_peak


def _reloads(plan: OffloadPlan | None, pos: int, kept_until_w: float) -> list[tuple[tuple[int, int, int], float]]:
    """(unit, share of its activation) coming back at pass ``pos``: saved activations, then W-kept ones."""
    if plan is None:
        return []
    return [(u, 1.0) for u in plan.reload_at.get(pos, ())] + [(u, kept_until_w) for u in plan.w_reload_at.get(pos, ())]
