"""A measured cut's stages balanced for the schedule that runs them (``partition_method: profile``).

``partition.cut_layers`` balances ranks: a rank's time is the sum of its stages' times. Where
a rank holds one stage that is the whole story. Where it holds several (V and looped
placements) it is not: the schedule gives each stage's passes their own slots, and a cut whose
ranks sum alike but whose stages do not (one rank's two stages an embedding alone and half the
blocks with the head, say) leaves ranks waiting on the long stage. Alike blocks make such cuts
tie exactly on rank sums, and the memory tie-break of ``cut_layers`` then picks whichever holds
the least activation, however its stages run.

``refine_cut`` judges a cut by the step the schedule's simulator gives when each stage's
passes take its layers' share of the time (``Costs.stage_scale``). It searches from the cut
it is given and from a cut whose longest stage is shortest, each time taking the move
(``partition.boundary_moves``) that shortens the simulated step most, until none does. Then,
among cuts within ``time_slack`` of the shortest step found, it moves toward less memory on
the busiest rank, from every start and search result within that limit, and keeps the
leanest (the trade ``cut_layers`` makes, judged by the step instead of the rank sums). It is
a local search: its step is the least it found, never longer than the given cut's (with
``time_slack`` 0). It counts simulations, not seconds, so every run gets the same cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .costs import Costs
from .ir import Schedule
from .partition import Cut, LayerCost, boundary_moves, cut_layers, rank_loads, slack_limit
from .simulate import simulate

__all__ = ["profile_cut", "refine_cut", "simulated_step"]

# Simulations one refinement may run: each walks the whole schedule once, milliseconds at p=8
# and 32 micro-batches, and the other ranks wait for rank 0's cut meanwhile.
_SIMULATIONS = 1_500

Parts = tuple[int, ...]


def simulated_step(parts: Sequence[int], costs: Sequence[LayerCost], schedule: Schedule) -> float:
    """The schedule's simulated step when stage ``s`` runs layers ``parts[s]:parts[s+1]`` (F, B and W
    each a third of a layer's time; only ratios between cuts matter)."""
    times = [sum(c.time for c in costs[parts[s]:parts[s + 1]]) for s in range(schedule.num_model_stages)]
    total = sum(times)
    if total <= 0:
        return 0.0
    balanced = total / schedule.num_model_stages  # a stage's time in an even cut: scale 1
    return simulate(schedule, Costs(stage_scale=tuple(t / balanced for t in times))).makespan


def profile_cut(costs: Sequence[LayerCost], schedule: Schedule, *, inflight: Sequence[float] | None = None,
                time_slack: float = 0.02) -> Cut:
    """The cut ``partition_method: profile`` runs: ``cut_layers`` for the schedule's placement, refined for the
    schedule where a rank holds several stages (``refine_cut``)."""
    cut = cut_layers(costs, schedule.stage_to_rank, inflight=inflight, time_slack=time_slack)
    return refine_cut(cut, costs, schedule, inflight=inflight, time_slack=time_slack)


def refine_cut(cut: Cut, costs: Sequence[LayerCost], schedule: Schedule, *, inflight: Sequence[float] | None = None,
               time_slack: float = 0.02) -> Cut:
    """``cut`` with its boundaries moved to shorten ``schedule``'s simulated step, then to lighten the busiest
    rank's memory within ``time_slack`` of that step; ``cut`` itself where every rank holds one stage."""
    placement = tuple(schedule.stage_to_rank)
    parts = tuple(int(b) for b in cut.parts)
    if len(parts) != len(placement) + 1 or parts[0] != 0 or parts[-1] != len(costs) or any(a >= b for a, b in zip(parts, parts[1:])):
        raise ValueError(f"the cut {list(parts)} is not {len(placement)} non-empty stages of {len(costs)} layers "
                         f"({schedule.name}'s placement {list(placement)})")
    if len(set(placement)) == len(placement):
        return cut  # one stage per rank: the rank sums are the stages, cut_layers balanced them
    held = tuple(inflight) if inflight is not None else (1.0,) * len(placement)
    step = _Counted(lambda q: simulated_step(q, costs, schedule))

    def memory(q: Parts) -> float:
        return max(rank_loads(q, costs, placement, inflight=held)[1])

    # A cut whose longest stage is shortest (each stage as if a rank of its own): rank sums tie across
    # cuts that only several moves together join, and the balanced one is among the good ones.
    even = tuple(int(b) for b in cut_layers(costs, tuple(range(len(placement))), inflight=held, time_slack=0.0).parts)
    starts = [parts, even]
    found = [_descend(start, step, step) for start in starts]
    limit = slack_limit(min(step(q) for q in found), time_slack)
    lean = [_descend(q, memory, step, limit=limit) for q in (*starts, *found) if step(q) <= limit]
    best = min(lean, key=lambda q: (memory(q), step(q)))
    times, mem = rank_loads(best, costs, placement, inflight=held)
    return Cut(best, times, mem)


class _Counted:
    """The simulated step per cut, remembered; ``left`` counts the simulations still allowed."""

    def __init__(self, fn: Callable[[Parts], float]) -> None:
        self.fn = fn
        self.seen: dict[Parts, float] = {}
        self.left = _SIMULATIONS

    def __call__(self, parts: Parts) -> float:
        if parts not in self.seen:
            self.left -= 1
            self.seen[parts] = self.fn(parts)
        return self.seen[parts]


def _descend(parts: Parts, value: Callable[[Parts], float], step: _Counted, *, limit: float | None = None) -> Parts:
    """Take the move with the least ``value`` (its step within ``limit`` when given) while it lowers
    ``value``; ties within a relative 1e-9 keep the move found first. Stops when the budget is spent."""
    best = value(parts)
    while step.left > 0:
        chosen, chosen_value = None, best
        for q in boundary_moves(parts):
            v = value(q)  # memory is cheap; only a cut that would lower it is simulated for the limit
            if _below(v, chosen_value) and (limit is None or step(q) <= limit):
                chosen, chosen_value = q, v
            if step.left <= 0:
                break
        if chosen is None:
            break
        parts, best = chosen, chosen_value
    return parts


def _below(a: float, b: float) -> bool:
    return a < b - 1e-9 * max(abs(a), abs(b), 1e-30)
