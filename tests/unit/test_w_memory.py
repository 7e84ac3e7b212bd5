"""``Costs.w_memory``: the share of a unit's activation that split backward keeps from B to W.

The runtime's W needs the inputs and output gradients of the linear layers, so B frees only
part of an activation. Every split-backward generator must keep its memory bound counting
that share as live until W, i.e. as ``simulate(..., kept_until_w=costs.w_memory)`` counts.
"""

from __future__ import annotations

import math

import pytest

from ds_vshape.cli import main
from ds_vshape.schedules import Costs, generate, get_info, simulate
from ds_vshape.schedules.generators import vshape as vgen
from ds_vshape.schedules.render import compare_rows

SHARES = (0.0, 0.5, 1.0)
PS = range(2, 9)
SLOT = 0.5  # a V rank runs each of its two chunks' passes in half the unit time


def _bound(name: str, p: int) -> int:
    return {
        "v-min": (p + 4) // 3, "v-half": (p + 2) // 2, "v-zb": p, "v-adaptive": p,
        "zb-h1": p, "zb-h2": 2 * p - 1, "zb-auto": p,
    }[name]


def _costs(share: float) -> Costs:
    return Costs(f=1, b=1, w=1, w_memory=share)


# ---- Costs and simulate ----------------------------------------------------------------------
def test_costs_validate_the_share() -> None:
    assert Costs().w_memory == 0.0
    for bad in (-0.1, 1.01, math.nan):
        with pytest.raises(ValueError, match="w_memory"):
            Costs(w_memory=bad)


def test_simulate_counts_the_planned_share_by_default() -> None:
    schedule = generate("v-half", 4, 8)  # planned for share 0: W passes sit in late gaps
    for share in SHARES:
        costs = _costs(share)
        assert simulate(schedule, costs).peak_memory == simulate(schedule, costs, kept_until_w=share).peak_memory
    assert simulate(schedule, _costs(1.0), kept_until_w=0.0).max_peak_memory == 3.0  # explicit wins
    with pytest.raises(ValueError, match="kept_until_w"):
        simulate(schedule, kept_until_w=1.5)


# ---- the bounds --------------------------------------------------------------------------------
def _sizes(name: str) -> list[tuple[int, int]]:
    """p from 2 to 8 with m = p, 2p, 4p (where the schedule serves m)."""
    low = get_info(name).min_micro_batches
    return [(p, m) for p in PS for m in (p, 2 * p, 4 * p) if m >= low(p, 1, 1)]


@pytest.mark.parametrize("name", ["v-min", "v-half", "v-zb", "v-adaptive"])
@pytest.mark.parametrize("share", SHARES)
def test_v_peak_within_bound_counting_the_share(name: str, share: float) -> None:
    costs = _costs(share)
    for p, m in _sizes(name):
        schedule = generate(name, p, m, costs=costs)  # generate validates
        assert simulate(schedule, costs).max_peak_memory <= _bound(name, p) + 1e-9, (p, m)
        # A runtime keeping more than planned stays bounded too.
        assert simulate(schedule, costs, kept_until_w=1.0).max_peak_memory <= 2 * _bound(name, p) + 1e-9, (p, m)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-auto"])
def test_zb_peak_within_bound_for_any_share(name: str) -> None:
    # Their bounds already count everything as live until W, so the order ignores the share.
    for p, m in _sizes(name):
        schedule = generate(name, p, m, costs=_costs(1.0))  # generate validates
        if m == 2 * p:
            assert schedule.ranks == generate(name, p, m, costs=_costs(0.0)).ranks
        for share in SHARES:
            assert simulate(schedule, _costs(share)).max_peak_memory <= _bound(name, p) + 1e-9, (p, m, share)


def test_the_measured_case_no_longer_exceeds_1f1b() -> None:
    # p=4, m=8 with 0.6 kept: v-half used to hold more than 1F1B on a real run.
    costs = _costs(0.6)
    ref = simulate(generate("1f1b", 4, 8, costs=costs), costs).max_peak_memory
    for name in ("v-half", "v-min", "v-zb"):
        assert simulate(generate(name, 4, 8, costs=costs), costs).max_peak_memory <= min(ref, _bound(name, 4))


@pytest.mark.parametrize("share", [0.3, 0.5, 1.0])
def test_memory_limits_hold_counting_the_share(share: float) -> None:
    costs = _costs(share)
    for p in (4, 6):
        for limit in (p / 2, p - 1, p):
            for name in ("v-adaptive", "zb-auto"):
                schedule = generate(name, p, 2 * p, memory_limit=limit, costs=costs)
                assert simulate(schedule, costs).max_peak_memory <= limit + 1e-9, (name, p, limit)


def test_adaptive_refuses_the_same_limits_whatever_the_share() -> None:
    for share in SHARES:
        with pytest.raises(ValueError, match=r"needs memory_limit >= 3 \(in M_B\)"):
            generate("v-adaptive", 8, 32, memory_limit=2.5, costs=_costs(share))


# ---- what it costs -----------------------------------------------------------------------------
def _idle_slots(name: str, p: int, share: float) -> float:
    costs = _costs(share)
    return max(simulate(generate(name, p, 4 * p, costs=costs), costs).idle) / SLOT


# Idle slots per rank from slot 0 at m = 4p, p = 4/8/12 (the REFERENCE at share 0: V-Min
# 11/27/41, V-Half 5/17/29). Early W passes cost bubbles, never more than these.
_IDLE = {
    ("v-min", 0.5): (11, 25, 41), ("v-min", 1.0): (13, 26, 43),
    ("v-half", 0.5): (6, 17, 29), ("v-half", 1.0): (7, 21, 35),
}


@pytest.mark.parametrize(("name", "share"), list(_IDLE))
def test_idle_with_the_share_kept(name: str, share: float) -> None:
    for p, most in zip((4, 8, 12), _IDLE[(name, share)]):
        assert _idle_slots(name, p, share) <= most, p
        assert _idle_slots(name, p, 0.0) <= _idle_slots(name, p, share)  # keeping more never helps


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_vzb_keeps_the_least_step_time(share: float) -> None:
    costs = _costs(share)
    for p in PS:
        for m in (2 * p, 4 * p):
            result = simulate(generate("v-zb", p, m, costs=costs), costs)
            assert result.makespan == pytest.approx((6 * m + p - 1) * SLOT)
            assert max(vgen.span_idle(result)) <= (p - 1) * SLOT


@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("p", [3, 4, 6])
def test_adaptive_keeps_its_guarantees_with_the_share(p: int, share: float) -> None:
    costs, m = _costs(share), 4 * p
    fixed = {name: simulate(generate(name, p, m, costs=costs), costs) for name in ("v-min", "v-half", "v-zb")}
    previous = math.inf
    for halves in range(2, 2 * p + 1):
        try:
            schedule = generate("v-adaptive", p, m, memory_limit=halves / 2, costs=costs)
        except ValueError:
            assert previous == math.inf  # only limits below the feasible minimum are refused
            continue
        span = max(vgen.span_idle(simulate(schedule, costs)))
        assert span <= previous  # more memory never adds bubbles
        previous = span
        for name, result in fixed.items():
            if halves == 2 * _bound(name, p):
                assert span <= max(vgen.span_idle(result))


# ---- front ends ------------------------------------------------------------------------------
def test_compare_rows_plan_and_count_with_the_share() -> None:
    rows = {r["name"]: r for r in compare_rows(4, 8, w_memory=1.0)}
    assert rows["v-half"]["peak_memory"] <= 3
    planned_for_zero = {r["name"]: r for r in compare_rows(4, 8, kept_until_w=1.0)}
    assert planned_for_zero["v-half"]["peak_memory"] > 3  # what the runtime held before


def test_cli_w_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-s", "v-half", "-p", "4", "-m", "8", "--w-memory", "0.6"]) == 0
    assert "w_memory=0.6, kept until W=0.6" in capsys.readouterr().out
    assert main(["compare", "-p", "4", "-m", "8", "--w-memory", "1"]) == 0
    assert "v-half" in capsys.readouterr().out
    assert main(["export", "-s", "v-min", "-p", "4", "-m", "8", "--w-memory", "0.5"]) == 0
    capsys.readouterr()
    assert main(["simulate", "-s", "v-half", "-p", "4", "-m", "8", "--w-memory", "1.5"]) == 2
    assert "--w-memory" in capsys.readouterr().err
