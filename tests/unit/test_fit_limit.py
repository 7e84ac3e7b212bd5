"""``moved_share_limit``: how much of W's work a schedule can take into B and stay no slower than 1F1B."""

from __future__ import annotations

import pytest

from ds_vshape.schedules import Costs, generate, simulate
from ds_vshape.schedules.fit_limit import moved_share_limit


def _makespan(name: str, p: int, m: int, share: float) -> float:
    schedule = generate(name, p, m, costs=Costs(w_memory=0.5))
    return simulate(schedule, Costs(f=1, b=1 + share, w=1 - share, w_memory=0.5)).makespan


@pytest.mark.parametrize(("name", "p", "m"), [("v-zb", 4, 8), ("v-half", 4, 8), ("v-min", 4, 16), ("v-half", 2, 8)])
def test_the_limit_is_the_last_share_that_keeps_the_schedule_at_1f1b(name: str, p: int, m: int) -> None:
    limit = moved_share_limit(generate(name, p, m, costs=Costs(w_memory=0.5)))
    baseline = simulate(generate("1f1b", p, m)).makespan
    assert 0 < limit < 1
    assert _makespan(name, p, m, limit) <= baseline < _makespan(name, p, m, limit + 0.05)


def test_schedules_with_room_to_spare_may_move_everything() -> None:
    # ZB-H1 keeps 1F1B's order with W filling its bubble: all of W in B is 1F1B again.
    assert moved_share_limit(generate("zb-h1", 4, 8)) == 1.0


def test_the_baseline_is_1f1b_with_its_backward_fused() -> None:
    """By hand: 1F1B at p=2, m=8 with F, B and W one unit each takes (m + p - 1) * (F + B + W) = 27
    units; a V schedule moving no W work into B must be no longer than that to be allowed any."""
    assert simulate(generate("1f1b", 2, 8)).makespan == 27
    v_zb = generate("v-zb", 2, 8, costs=Costs(w_memory=0.5))
    assert _makespan("v-zb", 2, 8, 0.0) <= 27 and moved_share_limit(v_zb) > 0
