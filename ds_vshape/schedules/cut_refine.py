"""A measured cut's stages balanced for the schedule that runs them (``partition_method: profile``).

``partition.cut_layers`` balances ranks: a rank's time is the sum of its stages' times. Where
a rank holds one stage that is the whole story. Where it holds several (V and looped
placements) it is not: the schedule gives each stage's passes their own slots, and a cut whose
ranks sum alike but whose stages do not (one rank's two stages an embedding alone and half the
blocks with the head, say) leaves ranks waiting on the long stage. Alike blocks make such cuts
tie exactly on rank sums, and the memory tie-break of ``cut_layers`` then picks whichever holds
the least activation, however its stages run.

``refine_cut`` judges a cut by the step the schedule's simulator gives when each stage's
passes take its layers' share of the time (``Costs.stage_scale``). From the cut it is given, and
again from the cut whose longest stage is shortest, it moves one stage boundary at a time to the
position that shortens the simulated step most, until no move does, and keeps the shorter; then, among cuts whose step is within ``time_slack`` of that one, it moves
boundaries the same way toward less busiest-rank memory (the trade ``cut_layers`` makes,
judged by the step instead of the rank sums). The search counts simulations, not seconds,
so every rank and every run gets the same cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .costs import Costs
from .ir import Schedule
from .partition import Cut, LayerCost, cut_layers, rank_loads
from .simulate import simulate

__all__ = ["refine_cut", "simulated_step"]

# Each simulation walks the whole schedule once; this bounds the search on large models (the
# cut found by then is kept: never worse than the one given).
_SIMULATIONS = 4_000


def simulated_step(parts: Sequence[int], costs: Sequence[LayerCost], schedule: Schedule) -> float:
    """The schedule's simulated step when stage ``s`` runs layers ``parts[s]:parts[s+1]`` (F, B and W
    each a third of a layer's time; only ratios between cuts matter)."""
    times = [sum(c.time for c in costs[parts[s]:parts[s + 1]]) for s in range(schedule.num_model_stages)]
    total = sum(times)
    if total <= 0:
        return 0.0
    balanced = total / schedule.num_model_stages  # a stage's time in an even cut: scale 1
    return simulate(schedule, Costs(stage_scale=tuple(t / balanced for t in times))).makespan


def refine_cut(cut: Cut, costs: Sequence[LayerCost], schedule: Schedule, *, inflight: Sequence[float] | None = None,
               time_slack: float = 0.02) -> Cut:
    """``cut`` with its boundaries moved to shorten ``schedule``'s simulated step, then to lighten the busiest
    rank's memory within ``time_slack`` of that step; ``cut`` itself where a rank holds one stage."""
    placement = tuple(schedule.stage_to_rank)
    if len(cut.parts) != len(placement) + 1:
        raise ValueError(f"the cut has {len(cut.parts) - 1} stages, {schedule.name}'s placement {len(placement)}")
    if len(set(placement)) == len(placement):
        return cut  # one stage per rank: the rank sums are the stages, cut_layers balanced them
    held = tuple(inflight) if inflight is not None else (1.0,) * len(placement)
    budget = [_SIMULATIONS]
    steps: dict[tuple[int, ...], float] = {}

    def step(parts: tuple[int, ...]) -> float:
        if parts not in steps:
            budget[0] -= 1
            steps[parts] = simulated_step(parts, costs, schedule)
        return steps[parts]

    def memory(parts: tuple[int, ...]) -> float:
        return max(rank_loads(parts, costs, placement, inflight=held)[1])

    # Two starts: the cut given, and the cut whose longest stage is shortest (each stage as if a rank
    # of its own): rank sums tie across cuts that only a move of several boundaries at once joins.
    even = cut_layers(costs, tuple(range(len(placement))), inflight=held, time_slack=time_slack).parts
    starts = [tuple(int(b) for b in cut.parts), tuple(int(b) for b in even)]
    parts = min((_descend(start, lambda q: (step(q),), budget) for start in starts), key=step)
    limit = step(parts) * (1 + time_slack) + 1e-12
    parts = _descend(parts, lambda q: (memory(q), step(q)), budget, admissible=lambda q: step(q) <= limit)
    times, mem = rank_loads(parts, costs, placement, inflight=held)
    return Cut(parts, times, mem)


def _descend(parts: tuple[int, ...], key: Callable[[tuple[int, ...]], tuple[float, ...]], budget: list[int], *,
             admissible: Callable[[tuple[int, ...]], bool] = lambda q: True) -> tuple[int, ...]:
    """Move one interior boundary at a time to the admissible position with the least ``key`` (keys
    within a relative 1e-9 count as equal, the first found kept), until no move lowers it."""
    best = key(parts)
    while budget[0] > 0:
        move = None
        for i in range(1, len(parts) - 1):
            for pos in range(parts[i - 1] + 1, parts[i + 1]):
                if pos == parts[i] or budget[0] <= 0:
                    continue
                q = parts[:i] + (pos,) + parts[i + 1:]
                if admissible(q) and _lower(key(q), best if move is None else move[1]):
                    move = (q, key(q))
        if move is None:
            break
        parts, best = move
    return parts


def _lower(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """``a`` below ``b`` in order, ties within a relative 1e-9 passed over to the next entry."""
    for x, y in zip(a, b):
        if x < y - 1e-9 * max(abs(x), abs(y), 1e-30):
            return True
        if x > y + 1e-9 * max(abs(x), abs(y), 1e-30):
            return False
    return False
