"""ZB-H1, ZB-H2 and zb-auto: the paper's step times and memory, measured by the simulator."""

from __future__ import annotations

import pytest

from ds_vshape.schedules import Costs, Kind, generate, get_info, linear, simulate, validate
from ds_vshape.schedules.generators.zero_bubble import GreedyPolicy, greedy_schedule

UNIT = Costs(f=1, b=1, w=1)
# T_W < T_F < T_B, as the paper measures for a transformer layer, plus a slow link
REALISTIC = (Costs(f=1, b=1.2, w=0.8), Costs(f=1, b=1.5, w=0.5), Costs(f=1, b=1, w=0.5))
PS = range(2, 9)


def _span_idle(result) -> float:
    """Largest idle time inside one rank's span (first start to last end)."""
    return max(t[-1][1] - t[0][0] - busy for t, busy in zip(result.timeline, result.busy))


def _ms(p: int, lo: int) -> range:
    return range(lo, 4 * p + 1)


# ---- ZB-H1 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", PS)
def test_zb_h1_makespan_is_the_paper_formula(p: int) -> None:
    for m in _ms(p, p):
        schedule = generate("zb-h1", p, m)
        result = simulate(schedule, UNIT)
        assert result.makespan == pytest.approx(m * 3 + (p - 1) * (1 + 1 - 1)), (p, m)
        assert result.max_peak_memory <= p
        # p even counting a micro-batch as live until its W (B keeps everything for W)
        assert simulate(schedule, UNIT, kept_until_w=1.0).max_peak_memory <= p


@pytest.mark.parametrize("costs", REALISTIC)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_formula_holds_for_realistic_costs(p: int, costs: Costs) -> None:
    f, b, w = costs.f, costs.b, costs.w
    for m in (p, 2 * p, 4 * p):
        result = simulate(generate("zb-h1", p, m), costs)
        assert result.makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w)), (p, m)


@pytest.mark.parametrize("p", PS)
def test_zb_h1_with_few_micro_batches(p: int) -> None:
    # m <= p: (m+p-1)(T_F+T_B) + T_W, the reference's figure for zero bubble at small m
    for m in range(1, p + 1):
        assert simulate(generate("zb-h1", p, m), UNIT).makespan == pytest.approx((m + p - 1) * 2 + 1), (p, m)


def test_zb_h1_beats_1f1b_by_p_minus_1_times_2() -> None:
    for p in PS:
        m = 2 * p
        gap = simulate(generate("1f1b", p, m), UNIT).makespan - simulate(generate("zb-h1", p, m), UNIT).makespan
        assert gap == pytest.approx(2 * (p - 1))


# ---- ZB-H2 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", PS)
def test_zb_h2_has_no_bubble_inside_any_rank(p: int) -> None:
    # Zero bubble in the paper's sense: every rank runs without an idle slot from its first
    # pass to its last (a parallelogram; rank r starts at r T_F). Holds for m >= 2p-1.
    for m in _ms(p, 2 * p - 1):
        schedule = generate("zb-h2", p, m)
        result = simulate(schedule, UNIT)
        assert _span_idle(result) == pytest.approx(0.0), (p, m)
        # one step alone still has the last rank start (p-1) T_F late: the parallelogram
        assert result.makespan == pytest.approx(3 * m + (p - 1)), (p, m)
        assert result.max_peak_memory <= 2 * p - 1
        assert result.peak_memory[0] == 2 * p - 1
        assert simulate(schedule, UNIT, kept_until_w=1.0).max_peak_memory <= 2 * p - 1


@pytest.mark.parametrize("costs", REALISTIC)
def test_zb_h2_span_is_the_paper_formula(costs: Costs) -> None:
    f, b, w = costs.f, costs.b, costs.w
    for p in (2, 4, 8):
        for m in (2 * p - 1, 4 * p):
            result = simulate(generate("zb-h2", p, m), costs)
            span = max(t[-1][1] - t[0][0] for t in result.timeline)
            assert span == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - 2 * w)), (p, m)


def test_zb_h2_needs_2p_minus_1_micro_batches() -> None:
    assert get_info("zb-h2").min_micro_batches(4, 1, 1) == 7
    with pytest.raises(ValueError, match="at least 7 micro-batches"):
        generate("zb-h2", 4, 6)
    from ds_vshape.schedules.generators.zero_bubble import zb_h2

    with pytest.raises(ValueError, match="2p-1 = 7"):
        zb_h2(4, 6)


# ---- zb-auto -------------------------------------------------------------------------------
@pytest.mark.parametrize("costs", (UNIT, *REALISTIC, Costs(f=1, b=1, w=1, comm=0.2)))
@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_zb_auto_no_worse_than_zb_h1_at_memory_p(p: int, costs: Costs) -> None:
    for m in (p, 2 * p, 4 * p):
        schedule = generate("zb-auto", p, m, costs=costs)
        h1 = simulate(generate("zb-h1", p, m), costs)
        assert simulate(schedule, costs).makespan <= h1.makespan + 1e-9, (p, m)
        assert simulate(schedule, costs, kept_until_w=1.0).max_peak_memory <= p + 1e-9


@pytest.mark.parametrize("p, limit", [(4, 6), (8, 10)])
def test_zb_auto_uses_memory_between_p_and_2p_minus_1(p: int, limit: int) -> None:
    costs = Costs(f=1, b=1.2, w=0.8)
    auto = simulate(generate("zb-auto", p, 4 * p, memory_limit=limit, costs=costs), costs)
    assert auto.makespan < simulate(generate("zb-h1", p, 4 * p), costs).makespan - 0.3


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_auto_respects_its_memory_limit(p: int) -> None:
    costs = Costs(f=1, b=1.2, w=0.8, comm=0.1)
    m = 2 * p
    last = None
    for limit in sorted({1, 1.5, 2, p // 2 or 1, p, p + 1, 2 * p - 1}):
        schedule = generate("zb-auto", p, m, memory_limit=limit, costs=costs)
        for kept in (0.0, 0.5, 1.0):  # whatever share of the activation B keeps for W
            assert simulate(schedule, costs, kept_until_w=kept).max_peak_memory <= limit + 1e-9, (p, limit, kept)
        result = simulate(schedule, costs)
        if last is not None:
            assert result.makespan <= last + 1e-9, "more memory never makes the search slower"
        last = result.makespan


def test_zb_auto_with_2p_minus_1_reaches_zb_h2() -> None:
    for p in (2, 4, 8):
        m = 4 * p
        auto = simulate(generate("zb-auto", p, m, memory_limit=2 * p - 1, costs=REALISTIC[0]), REALISTIC[0])
        assert auto.makespan <= simulate(generate("zb-h2", p, m), REALISTIC[0]).makespan + 1e-9


def test_zb_auto_rejects_a_limit_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        generate("zb-auto", 4, 8, memory_limit=0.5)


@pytest.mark.parametrize("policy", GreedyPolicy.grid(), ids=lambda pol: pol.name)
def test_every_greedy_policy_is_valid_and_within_memory(policy: GreedyPolicy) -> None:
    for costs in (UNIT, Costs(f=1, b=2, w=0, comm=0.5), Costs(f=1, b=1, w=1, comm=2)):
        for p in (2, 3, 5):
            for m in (1, p - 1 or 1, p, 2 * p + 1):
                for limit in (1, 2, p, 2 * p):
                    schedule = validate(greedy_schedule(p, m, costs=costs, memory_limit=limit, policy=policy))
                    assert simulate(schedule, costs, kept_until_w=1.0).max_peak_memory <= limit + 1e-9


# ---- shared --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-auto"])
@pytest.mark.parametrize("p", PS)
def test_zero_bubble_schedules_validate(name: str, p: int) -> None:
    low = get_info(name).min_micro_batches(p, 1, 1)
    for m in _ms(p, low):
        schedule = generate(name, p, m)  # generate validates
        assert schedule.stage_to_rank == linear(p)
        assert schedule.uses_split_backward
        assert not any(a.kind is Kind.BW for _, _, a in schedule.actions())


def test_registry_flags() -> None:
    auto = get_info("zb-auto")
    assert auto.uses_costs and auto.memory_limit
    assert not get_info("zb-h1").memory_limit
    assert get_info("zb-h1").min_micro_batches(8, 1, 1) == 1
