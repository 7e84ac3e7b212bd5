"""V-shape schedules (v-zb, v-half, v-min, v-adaptive) against REFERENCE section 2.

Figures are in half-chunk slots: with Costs(f=1, b=1, w=1) a pass of one of a rank's two
chunks takes 0.5, so idle slots = idle time / 0.5. "Span idle" is the paper's count (idle
inside each rank's own first-to-last span); "makespan idle" is the simulator's (from 0).
"""

from __future__ import annotations

import time

import pytest

from ds_vshape.schedules import Costs, Kind, Schedule, generate, get_info, simulate, vshape
from ds_vshape.schedules.generators import _blocks as blocks
from ds_vshape.schedules.generators import vshape as vgen

V_NAMES = ("v-zb", "v-half", "v-min", "v-adaptive")
UNIT = Costs(f=1, b=1, w=1)
SLOT = 0.5

# REFERENCE section 2: idle slots per rank the reference generator leaves at m = 4p.
REF_IDLE = {"v-min": {4: 11, 8: 27, 12: 41}, "v-half": {4: 5, 8: 17, 12: 29}}


def _slots(schedule: Schedule) -> tuple[float, float]:
    """(worst span idle, worst makespan idle) in half-chunk slots."""
    result = simulate(schedule, UNIT)
    return max(vgen.span_idle(result)) / SLOT, max(result.idle) / SLOT


def _bound(name: str, p: int) -> float:
    return {"v-min": (p + 4) // 3, "v-half": (p + 2) // 2, "v-zb": p, "v-adaptive": p}[name]


# ---- registry and validity -----------------------------------------------------------------
def test_registered_with_v_placement_and_split_backward() -> None:
    assert get_info("zb-v").name == "v-zb"
    for name in V_NAMES:
        info = get_info(name)
        assert info.fixed_chunks == 2
        assert info.memory_limit is (name == "v-adaptive")
        schedule = generate(name, 4, 8)
        assert schedule.stage_to_rank == vshape(4)
        assert schedule.chunks_per_rank == 2
        assert not any(a.kind is Kind.BW for _, _, a in schedule.actions())
        assert schedule.uses_split_backward


@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize("p", range(2, 9))
def test_valid_from_minimum_to_4p(name: str, p: int) -> None:
    low = get_info(name).min_micro_batches(p, 2, 1)
    assert low == 1
    for m in range(low, 4 * p + 1):
        schedule = generate(name, p, m, check=True)  # raises ScheduleError when invalid
        assert schedule.micro_batches == m
        assert sum(len(r) for r in schedule.ranks) == 3 * 2 * p * m


@pytest.mark.parametrize("name", V_NAMES)
def test_too_few_micro_batches_names_the_minimum(name: str) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        generate(name, 4, 0)
    with pytest.raises(ValueError, match="at least 1"):
        get_info(name).fn(4, 0)


# ---- memory ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize("p", range(2, 9))
def test_peak_memory_within_bound(name: str, p: int) -> None:
    bound = _bound(name, p)
    for m in (1, p, 2 * p, 4 * p):
        schedule = generate(name, p, m)
        assert simulate(schedule, UNIT).max_peak_memory <= bound + 1e-9
        # Delayed W never holds more than the budget a second time, however W is retained.
        assert simulate(schedule, UNIT, kept_until_w=1.0).max_peak_memory <= 2 * bound + 1e-9


def test_vzb_block_holds_p_micro_batches() -> None:
    for p in range(2, 13):
        assert blocks.order_peak(blocks.repeat(vgen.vzb_block(p), 4 * p)) == 2 * p  # 2p halves = p M_B


# ---- bubbles ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["v-min", "v-half"])
@pytest.mark.parametrize("p", [4, 8, 12])
def test_idle_no_worse_than_reference_generator(name: str, p: int) -> None:
    span, makespan = _slots(generate(name, p, 4 * p))
    assert span <= REF_IDLE[name][p]
    assert makespan <= REF_IDLE[name][p]  # also when counted from slot 0


@pytest.mark.parametrize("p", range(2, 9))
def test_vzb_has_no_bubble_inside_any_rank_span(p: int) -> None:
    for m in (2 * p, 3 * p, 4 * p):
        result = simulate(generate("v-zb", p, m), UNIT)
        assert max(vgen.span_idle(result)) == 0.0
        # From slot 0 the last rank must start p-1 slots late: the step takes exactly
        # 6m + p - 1 slots, the least any V schedule can take.
        assert result.makespan == pytest.approx((6 * m + p - 1) * SLOT)
        assert result.bubble_rate == pytest.approx((p - 1) / (6 * m + p - 1))


def test_vzb_bubble_rate_below_one_percent_once_the_ramp_is_amortised() -> None:
    assert simulate(generate("v-zb", 4, 64), UNIT).bubble_rate < 0.01
    assert simulate(generate("v-zb", 8, 128), UNIT).bubble_rate < 0.01


# ---- v-adaptive ------------------------------------------------------------------------------
@pytest.mark.parametrize(("limit", "ref"), [(2, 11), (3, 5), (4, 0)])
def test_adaptive_p4_against_reference(limit: float, ref: int) -> None:
    schedule = generate("v-adaptive", 4, 16, memory_limit=limit)
    assert _slots(schedule)[0] <= ref
    assert simulate(schedule, UNIT).max_peak_memory <= limit


@pytest.mark.parametrize("p", [3, 4, 5, 6, 8])
def test_adaptive_bubble_never_rises_with_the_limit(p: int) -> None:
    for m in (p, 2 * p, 4 * p):
        previous: tuple[float, float] | None = None
        for halves in range(2, 2 * p + 3):
            limit = halves / 2
            try:
                schedule = generate("v-adaptive", p, m, memory_limit=limit)
            except ValueError:
                assert previous is None  # only limits below the feasible minimum are refused
                continue
            assert simulate(schedule, UNIT).max_peak_memory <= limit + 1e-9
            score = _slots(schedule)
            if previous is not None:
                assert score <= previous
            previous = score
        assert previous is not None and previous[0] == (0 if m >= 2 * p else previous[0])


@pytest.mark.parametrize("p", range(2, 9))
def test_adaptive_matches_the_fixed_schedules_at_their_budgets(p: int) -> None:
    m = 4 * p
    for name in ("v-min", "v-half", "v-zb"):
        adaptive = generate("v-adaptive", p, m, memory_limit=_bound(name, p))
        assert _slots(adaptive) <= _slots(generate(name, p, m))
    assert _slots(generate("v-adaptive", p, m)) == _slots(generate("v-zb", p, m))  # default limit p


def test_adaptive_refuses_a_limit_below_the_tightest_block() -> None:
    with pytest.raises(ValueError, match=r"needs memory_limit >= 3 \(in M_B\)"):
        generate("v-adaptive", 8, 32, memory_limit=2.5)
    with pytest.raises(ValueError, match="must be > 0"):
        generate("v-adaptive", 8, 32, memory_limit=0)


# ---- the framework ---------------------------------------------------------------------------
@pytest.mark.parametrize("p", range(2, 17))
def test_reference_blocks_are_members_of_the_offset_family(p: int) -> None:
    vmin, vhalf = blocks.vmin_block(p), blocks.vhalf_block(p)
    for block in (vmin, vhalf, vgen.vzb_block(p)):
        blocks.check_block(block)
    assert blocks.offset_block(p, vmin[0], (1, -1, 1, -1), (1, -1, 1, -1), p - 1) == vmin
    assert blocks.offset_block(p, vhalf[0], (2, -1, 2, -1), (2, -1, 2, -1), p - 1) == vhalf
    # REFERENCE's offsets for rank i, literally.
    g = 2 if p % 3 == 0 else 0
    assert vmin[p - 1] == (p - 1, p, 3 * p + g - 1, 3 * p + g)


def test_offset_block_refuses_colliding_residues() -> None:
    # rank 1 would put F0 (0 + 1) and F1 (2 - 1) on residue 1
    assert blocks.offset_block(4, (0, 2, 3, 4), (1, -1, 1, -1), (1, -1, 1, -1), 3) is None
    with pytest.raises(ValueError, match="dependency chain"):
        blocks.check_block(((0, 1, 2, 3), (0, 1, 2, 3)))


def test_squeeze_refuses_a_cap_below_the_block_peak() -> None:
    orders = blocks.repeat(blocks.vhalf_block(4), 16)
    with pytest.raises(ValueError, match="cap"):
        blocks.squeeze(4, 16, orders, cap=blocks.order_peak(orders) - 1, w_cap=99)


def test_all_v_schedules_generate_and_simulate_fast() -> None:
    vgen._choose.cache_clear()
    vgen._pool.cache_clear()
    start = time.process_time()
    for name in V_NAMES:
        simulate(generate(name, 8, 64), UNIT)
    assert time.process_time() - start < 1.0
