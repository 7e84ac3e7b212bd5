"""A measured cut's stages balanced for its schedule (``partition_method: profile``, ``cut_refine``)."""

from __future__ import annotations

import itertools
import random

import pytest

from ds_vshape.schedules import Schedule, generate
from ds_vshape.schedules import cut_refine
from ds_vshape.schedules.cut_refine import refine_cut, simulated_step
from ds_vshape.schedules.partition import LayerCost, cut_layers, rank_loads, slack_limit, stage_inflight

# The recipe's shape: an embedding, eight alike blocks, the head with the loss. Alike blocks tie
# the ranks' sums across many V cuts; memory then picks among them.
LLAMA = [LayerCost(0.3, 10.0, 1.0)] + [LayerCost(1.0, 100.0, 5.0)] * 8 + [LayerCost(0.8, 50.0, 1.0)]


def _all_steps(costs: list[LayerCost], schedule: Schedule) -> dict[tuple[int, ...], float]:
    n, stages = len(costs), schedule.num_model_stages
    return {(0, *c, n): simulated_step((0, *c, n), costs, schedule) for c in itertools.combinations(range(1, n), stages - 1)}


def _refined(name: str, *, slack: float, costs: list[LayerCost] = LLAMA, p: int = 2) -> tuple[Schedule, object, object]:
    schedule = generate(name, stages=p, micro_batches=8)
    held = stage_inflight(schedule)
    cut = cut_layers(costs, schedule.stage_to_rank, inflight=held)
    return schedule, cut, refine_cut(cut, costs, schedule, inflight=held, time_slack=slack)


@pytest.mark.parametrize("name", ["v-zb", "v-half", "v-min"])
def test_a_v_cut_tied_on_rank_sums_is_moved_to_the_shortest_simulated_step(name: str) -> None:
    schedule, cut, refined = _refined(name, slack=0.0)
    steps = _all_steps(LLAMA, schedule)
    # The rank-sum cut ties with the even one and runs a longer step; the refined one is the shortest of all cuts.
    assert rank_loads(cut.parts, LLAMA, schedule.stage_to_rank)[0] == rank_loads((0, 3, 5, 7, 10), LLAMA, schedule.stage_to_rank)[0]
    assert steps[tuple(int(b) for b in cut.parts)] > 1.05 * min(steps.values()), (cut.parts, min(steps.values()))
    assert steps[refined.parts] == pytest.approx(min(steps.values()), rel=1e-9), (refined.parts, min(steps, key=steps.get))
    held = stage_inflight(schedule)
    assert (refined.rank_time, refined.rank_memory) == rank_loads(refined.parts, LLAMA, schedule.stage_to_rank, inflight=held)


def test_within_the_slack_of_the_step_the_refined_cut_is_the_leanest() -> None:
    schedule, _, tight = _refined("v-zb", slack=0.0)
    _, _, loose = _refined("v-zb", slack=0.02)
    steps, held = _all_steps(LLAMA, schedule), stage_inflight(schedule)
    limit = slack_limit(min(steps.values()), 0.02)
    leanest = min(max(rank_loads(q, LLAMA, schedule.stage_to_rank, inflight=held)[1]) for q, s in steps.items() if s <= limit)
    assert loose.busiest_memory < tight.busiest_memory  # memory bought with a step still within the slack
    assert steps[loose.parts] <= limit and loose.busiest_memory == pytest.approx(leanest, rel=1e-12)


@pytest.mark.parametrize(("name", "p"), [("v-zb", 3), ("v-half", 4), ("interleaved", 2), ("interleaved", 4)])
def test_never_a_longer_step_than_the_cut_given(name: str, p: int) -> None:
    rng = random.Random(f"{name}{p}")
    for _ in range(6):
        schedule = generate(name, stages=p, micro_batches=8)
        stages = schedule.num_model_stages
        n = rng.randint(stages, stages + 5)
        costs = [LayerCost(rng.choice((0.0, 0.2, 1.0, 3.0)) * rng.random(), 10 * rng.random(), rng.random()) for _ in range(n)]
        held = stage_inflight(schedule)
        cut = cut_layers(costs, schedule.stage_to_rank, inflight=held, time_slack=rng.choice((0.0, 0.05)))
        refined = refine_cut(cut, costs, schedule, inflight=held, time_slack=0.0)
        assert simulated_step(refined.parts, costs, schedule) <= simulated_step(cut.parts, costs, schedule) * (1 + 1e-9)
        assert refined.parts[0] == 0 and refined.parts[-1] == n and all(a < b for a, b in zip(refined.parts, refined.parts[1:]))


def test_a_linear_placement_keeps_its_cut_and_a_spent_budget_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    one_per_rank = generate("zb-h2", stages=2, micro_batches=8)
    cut = cut_layers(LLAMA, one_per_rank.stage_to_rank)
    assert refine_cut(cut, LLAMA, one_per_rank) is cut
    monkeypatch.setattr(cut_refine, "_SIMULATIONS", 1)  # the starts are simulated, no move is
    schedule, cut, spent = _refined("v-zb", slack=0.0)
    even = cut_layers(LLAMA, tuple(range(schedule.num_model_stages)), inflight=stage_inflight(schedule), time_slack=0.0)
    starts = [tuple(int(b) for b in c.parts) for c in (cut, even)]
    assert spent.parts == min(starts, key=lambda q: simulated_step(q, LLAMA, schedule))


def test_a_cut_that_is_not_the_schedules_stages_is_refused() -> None:
    v = generate("v-zb", stages=2, micro_batches=8)
    with pytest.raises(ValueError, match="is not 4 non-empty stages of 10 layers"):
        refine_cut(cut_layers(LLAMA, (0, 1)), LLAMA, v)
    with pytest.raises(ValueError, match="is not 4 non-empty stages of 9 layers"):
        refine_cut(cut_layers(LLAMA, (0, 1, 1, 0)), LLAMA[:9], v)
