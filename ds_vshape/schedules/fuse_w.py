"""Fuse the W passes that fill no bubble back into their B (``fuse_idle_w``).

Split backward exists to move weight-gradient work (W) into the time a rank would otherwise
wait. A W that runs where its rank never waits buys nothing, and every split unit costs host
time a fused backward does not: its forward is routed, B and W are two passes, W re-reads what
B handed over. Where the host is the bottleneck (eager transformer blocks at short sequences on a
GPU) that cost is a large share of the pass.

``fuse_idle_w`` tries the split units by when their B starts and turns ``B ... W`` of one unit
into one ``BW`` at B's place wherever the step, simulated, ends no later than the schedule's own
under every cost profile of ``_fusion_profiles`` (the given costs, and pass times straying from
them, as real ones do), and tries the rest again until none fuses. Each try re-times the timeline from the
change on, only where something moves. A fused unit then runs as 1F1B runs it: a plain forward
and one fused backward. Memory only goes down (a fused unit frees what W would have kept at
once). Where trying would cost the front door too long (``_BUDGET``: tight V schedules over many
micro-batches move most of their timeline for every fusion tried, and take few), trying stops
and what fused so far stands.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from .costs import Costs
from .ir import Action, Kind, Schedule
from .simulate import simulate
from .validate import prerequisites

__all__ = ["fuse_idle_w"]

_EPS = 1e-9  # simulated times are sums of a few costs: a fusion that delays by less is none
# Passes re-timed before trying stops: a tight schedule (V-ZB over many micro-batches) moves most of its
# timeline for every fusion tried and fuses few; this bounds the front door's time. A trial's copy of
# the timeline counts as ``_COPY_SHARE`` of its passes.
_BUDGET = 100_000
_COPY_SHARE = 1 / 64
# How far pass times may stray from the costs with a fusion still ending the step no later: B either way
# (the split's B is cheaper than a fused backward's share, a host-bound one dearer), W down and F up (both
# take time from the bubbles W fills), an end stage up (embedding, LM head, loss).
_SLACK = 0.3


def fuse_idle_w(schedule: Schedule, *, costs: Costs | None = None) -> Schedule:
    """``schedule`` with each W that fills no bubble fused into its B (module doc); the same object
    when nothing fuses. ``params["fused_w"]`` counts the units fused here."""
    costs = costs or Costs()
    if not schedule.uses_split_backward:
        return schedule
    states = [_Timeline(schedule, c) for c in _fusion_profiles(schedule, costs)]
    fused = 0
    progress = True
    while progress and _left(states) >= 0:  # a fusion can free time for one tried before it: again until none
        progress = False
        for unit in states[0].in_time_order():
            if _left(states) < 0:
                break  # a long schedule whose fusions keep moving most of it: what fused so far stands
            rank = schedule.stage_to_rank[unit[0]]
            trials = []
            for state in states:  # stops at the first profile whose step would end later
                trial = state.trial(rank, unit)
                if trial is None:
                    break
                trials.append(trial)
            if len(trials) == len(states):
                for state, trial in zip(states, trials):
                    state.commit(*trial)
                fused, progress = fused + 1, True
    if not fused:
        return schedule
    ranks = tuple(tuple(row) for row in states[0].rows)
    return replace(schedule, ranks=ranks, params={**schedule.params, "fused_w": schedule.params.get("fused_w", 0) + fused})


def _fusion_profiles(schedule: Schedule, costs: Costs) -> list[Costs]:
    """The costs under each of which a fusion must end the step no later than the schedule's own: the
    given ones; B, W and F each ``_SLACK`` off them; the first or the last model stage that much slower
    (the embedding, the LM head and the loss). Real passes never cost what the schedule was made for."""
    stages = schedule.num_model_stages
    heavy = [tuple(1.0 + _SLACK * (s == edge) for s in range(stages)) for edge in (0, stages - 1)]
    return [costs,
            replace(costs, b=costs.b * (1 + _SLACK)), replace(costs, b=costs.b * (1 - _SLACK)),
            replace(costs, w=costs.w * (1 - _SLACK)), replace(costs, f=costs.f * (1 + _SLACK)),
            *(replace(costs, stage_scale=tuple(a * b for a, b in zip(costs.stage_scale or (1.0,) * stages, scale)))
              for scale in heavy)]


def _left(states: list[_Timeline]) -> int:
    """What is left of ``_BUDGET``, shared by the profiles' timelines."""
    return _BUDGET - sum(_BUDGET - s.budget for s in states)


class _Timeline:
    """Every rank's passes with their simulated start and end (by ``_pass``), and who waits for what."""

    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        self.costs, self.v, self.k = costs, schedule.chunks_per_rank, schedule.seq_chunks
        self.stages, self.owner = schedule.num_model_stages, schedule.stage_to_rank
        result = simulate(schedule, costs, kept_until_w=0.0)
        self.makespan = result.makespan
        self.rows: list[list[Action]] = [[a for _, _, a in row] for row in result.timeline]
        self.times: dict[tuple, tuple[float, float]] = {}  # pass -> (start, end)
        self.waiting: dict[tuple, list[tuple]] = defaultdict(list)  # pass -> the passes waiting for it
        self.info: dict[Action, tuple[tuple, float, tuple[tuple[tuple, float], ...]]] = {}
        for row in result.timeline:
            for start, end, action in row:
                key, _, waits = self._info(action)
                self.times[key] = (start, end)
                for producer, _ in waits:
                    self.waiting[producer].append(key)
        self.position = {_pass(a): i for row in self.rows for i, a in enumerate(row)}
        self.budget = _BUDGET

    def in_time_order(self) -> list[tuple[int, int, int]]:
        """The split units, by when their B starts."""
        units = [key[0] for key in self.times if key[1] == "W"]
        return sorted(units, key=lambda unit: (self.times[(unit, "backward")][0], unit))

    def trial(self, rank: int, unit: tuple[int, int, int]) -> tuple[list, dict, dict] | None:
        """The rows, positions and times with ``unit``'s B and W fused on ``rank``, if the step, simulated
        again, ends no later; else None. Nothing changes until ``commit``."""
        row, w_pass = self.rows[rank], (unit, "W")
        b, w = self.position[(unit, "backward")], self.position[w_pass]
        rows = list(self.rows)
        rows[rank] = [*row[:b], Action(Kind.BW, *unit), *row[b + 1:w], *row[w + 1:]]
        position = {**self.position, **{_pass(a): i for i, a in enumerate(rows[rank])}}
        del position[w_pass]
        times = dict(self.times)
        del times[w_pass]
        self.budget -= int(len(times) * _COPY_SHARE) + 1
        return (rows, position, times) if self._settle(rows, position, times, rank, b) else None

    def commit(self, rows: list[list[Action]], position: dict[tuple, int], times: dict[tuple, tuple[float, float]]) -> None:
        self.rows, self.position, self.times = rows, position, times

    def _settle(self, rows: list[list[Action]], position: dict[tuple, int], times: dict[tuple, tuple[float, float]],
                reordered: int, first: int) -> bool:
        """Each pass's earliest start again (``times`` in place) after ``reordered``'s row changed from
        ``first`` on, visiting only what moves (all of that row after ``first``: the times kept are of
        another order); whether every rank still ends within the schedule's step."""
        marks: dict[int, set[int]] = {reordered: {first}}
        while marks:
            # The rank whose first marked pass started earliest: what it waits for has mostly settled, so
            # a rank is rarely re-timed on inputs that move again (an early refusal only loses a fusion).
            rank = min(marks, key=lambda r: (times[_pass(rows[r][min(marks[r])])][0], r))
            marked = marks.pop(rank)
            row, last = rows[rank], len(rows[rank]) if rank == reordered else max(marked)
            at = min(marked)
            clock = times[_pass(row[at - 1])][1] if at else 0.0
            for action in row[at:]:
                key, duration, waits = self._info(action)
                start = max(clock, max((times[p][1] + add for p, add in waits), default=0.0))
                clock = start + duration
                if clock > self.makespan + _EPS:
                    return False  # a row's passes end in order: this rank would end late
                old, times[key] = times[key], (start, clock)
                self.budget -= 1
                if at >= last and old == (start, clock):
                    break  # as before, and nothing after it waits on what moved: the rest of the row stands
                if old[1] != clock:  # any change moves on (small ones added up would part from simulate's)
                    for waiter in self.waiting[key]:
                        where = position.get(waiter)  # None: a W fused away
                        if where is not None:
                            marks.setdefault(self.owner[waiter[0][0]], set()).add(where)
                at += 1
        return True

    def _info(self, action: Action) -> tuple[tuple, float, tuple[tuple[tuple, float], ...]]:
        """The pass's key, its duration, and what it waits for: (pass, latency to add) each."""
        info = self.info.get(action)
        if info is None:
            rank = self.owner[action.stage]
            waits = tuple(((event[1:], "F" if event[0] is Kind.F else "backward"),
                           0.0 if self.owner[event[1]] == rank else self.costs.comm)
                          for event in prerequisites(action, num_model_stages=self.stages, seq_chunks=self.k))
            info = self.info[action] = (_pass(action), self.costs.duration(action, chunks_per_rank=self.v, seq_chunks=self.k),
                                        waits)
        return info


def _pass(action: Action) -> tuple:
    """A pass by what it is to the others, so that a B and the BW fused from it are one: F, backward or W."""
    role = "F" if action.kind is Kind.F else "W" if action.kind is Kind.W else "backward"
    return (action.unit, role)
