"""A measured cut's stages balanced for its schedule (``partition_method: profile``, ``cut_refine``)."""

from __future__ import annotations

import itertools
import random

import pytest

from ds_vshape.schedules import generate
from ds_vshape.schedules import cut_refine
from ds_vshape.schedules.cut_refine import refine_cut, simulated_step
from ds_vshape.schedules.partition import LayerCost, cut_layers, rank_loads, stage_inflight

# The recipe's shape: an embedding, eight alike blocks, the head with the loss. Alike blocks tie
# the ranks' sums across many V cuts; memory then picks among them.
LLAMA = [LayerCost(0.3, 10.0, 1.0)] + [LayerCost(1.0, 100.0, 5.0)] * 8 + [LayerCost(0.8, 50.0, 1.0)]


def _all_steps(costs: list[LayerCost], schedule: object) -> dict[tuple[int, ...], float]:
    n, stages = len(costs), schedule.num_model_stages  # type: ignore[attr-defined]
    return {(0, *c, n): simulated_step((0, *c, n), costs, schedule)  # type: ignore[arg-type]
            for c in itertools.combinations(range(1, n), stages - 1)}


@pytest.mark.parametrize("name", ["v-zb", "v-half", "v-min"])
def test_a_v_cut_tied_on_rank_sums_is_moved_to_the_shortest_simulated_step(name: str) -> None:
    schedule = generate(name, stages=2, micro_batches=8)
    held = stage_inflight(schedule)
    cut = cut_layers(LLAMA, schedule.stage_to_rank, inflight=held)
    steps = _all_steps(LLAMA, schedule)
    refined = refine_cut(cut, LLAMA, schedule, inflight=held, time_slack=0.0)
    # The rank-sum cut ties with the even one and runs a longer step; the refined one is within a
    # hair of the shortest of all cuts (a local search: one boundary at a time).
    assert rank_loads(cut.parts, LLAMA, schedule.stage_to_rank)[0] == rank_loads((0, 3, 5, 7, 10), LLAMA, schedule.stage_to_rank)[0]
    assert steps[tuple(int(b) for b in cut.parts)] > 1.05 * min(steps.values()), (cut.parts, min(steps.values()))
    assert steps[refined.parts] <= 1.005 * min(steps.values()), (refined.parts, min(steps, key=steps.get))
    assert (refined.rank_time, refined.rank_memory) == rank_loads(refined.parts, LLAMA, schedule.stage_to_rank, inflight=held)


def test_within_the_slack_of_the_step_the_refined_cut_holds_less_memory() -> None:
    schedule = generate("v-zb", stages=2, micro_batches=8)
    held = stage_inflight(schedule)
    cut = cut_layers(LLAMA, schedule.stage_to_rank, inflight=held)
    tight = refine_cut(cut, LLAMA, schedule, inflight=held, time_slack=0.0)
    loose = refine_cut(cut, LLAMA, schedule, inflight=held, time_slack=0.5)
    assert loose.busiest_memory <= tight.busiest_memory
    assert simulated_step(loose.parts, LLAMA, schedule) <= 1.5 * simulated_step(tight.parts, LLAMA, schedule) + 1e-12


def test_never_a_longer_step_than_the_cut_given() -> None:
    rng = random.Random(7)
    for _ in range(12):
        name = rng.choice(("v-zb", "v-half", "interleaved"))
        schedule = generate(name, stages=2, micro_batches=8)
        n = rng.randint(5, 9)
        costs = [LayerCost(rng.choice((0.2, 1.0, 3.0)) * rng.random() + 0.01, 10 * rng.random(), rng.random()) for _ in range(n)]
        cut = cut_layers(costs, schedule.stage_to_rank, inflight=stage_inflight(schedule), time_slack=rng.choice((0.0, 0.05)))
        refined = refine_cut(cut, costs, schedule, inflight=stage_inflight(schedule), time_slack=0.0)
        assert simulated_step(refined.parts, costs, schedule) <= simulated_step(cut.parts, costs, schedule) * (1 + 1e-9)
        assert refined.parts[0] == 0 and refined.parts[-1] == n and all(a < b for a, b in zip(refined.parts, refined.parts[1:]))


def test_a_linear_placement_keeps_its_cut_and_a_spent_budget_keeps_the_better_start(monkeypatch: pytest.MonkeyPatch) -> None:
    one_per_rank = generate("zb-h2", stages=2, micro_batches=8)
    cut = cut_layers(LLAMA, one_per_rank.stage_to_rank)
    assert refine_cut(cut, LLAMA, one_per_rank) is cut
    v = generate("v-zb", stages=2, micro_batches=8)
    cut = cut_layers(LLAMA, v.stage_to_rank, inflight=stage_inflight(v))
    monkeypatch.setattr(cut_refine, "_SIMULATIONS", 2)  # the two starts' steps, no moves
    spent = refine_cut(cut, LLAMA, v, inflight=stage_inflight(v))
    assert simulated_step(spent.parts, LLAMA, v) <= simulated_step(cut.parts, LLAMA, v)


def test_a_cut_of_another_stage_count_is_refused() -> None:
    v = generate("v-zb", stages=2, micro_batches=8)
    with pytest.raises(ValueError, match="the cut has 2 stages"):
        refine_cut(cut_layers(LLAMA, (0, 1)), LLAMA, v)
