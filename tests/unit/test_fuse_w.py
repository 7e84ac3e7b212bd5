"""fuse_idle_w: the W passes that fill no bubble run fused with their B, and the step is never longer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ds_vshape.cli import main
from ds_vshape.config import ConfigError, parse_pipeline_config
from ds_vshape.schedules import Costs, Kind, Schedule, generate, get_info, simulate, validate
from ds_vshape.schedules import fuse_w
from ds_vshape.schedules.fuse_w import fuse_idle_w
from ds_vshape.schedules.lowering import lowered_orders

SPLIT = ("zb-h1", "zb-h2", "zb-auto", "v-zb", "v-half", "v-min")
CASES = [(name, p, m) for name in SPLIT for p in (2, 3, 4) for m in sorted({p, p + 1, 2 * p, 8})
         if m >= get_info(name).min_micro_batches(p, get_info(name).chunks(None), 1)]
COSTS = (Costs(), Costs(f=1.0, b=1.3, w=0.7, comm=0.05), Costs(f=1.0, b=2.0, w=1.0, comm=0.2))


def _fuse_one(schedule: Schedule, unit: tuple[int, int, int]) -> Schedule:
    rank = schedule.stage_to_rank[unit[0]]
    row = [a for a in schedule.ranks[rank] if not (a.kind is Kind.W and a.unit == unit)]
    row = [replace(a, kind=Kind.BW) if a.kind is Kind.B and a.unit == unit else a for a in row]
    return replace(schedule, ranks=tuple(tuple(row) if r == rank else actions for r, actions in enumerate(schedule.ranks)))


def _split_units(schedule: Schedule) -> list[tuple[int, int, int]]:
    return [a.unit for _, _, a in schedule.actions() if a.kind is Kind.W]


def _profiles(costs: Costs, stages: int) -> list[Costs]:
    """Written out here, not read from the module: pass times 30% off the given ones, as real ones stray."""
    end = [tuple(1.3 if s == edge else 1.0 for s in range(stages)) for edge in (0, stages - 1)]
    return [costs, replace(costs, b=costs.b * 1.3), replace(costs, b=costs.b * 0.7), replace(costs, w=costs.w * 0.7),
            replace(costs, f=costs.f * 1.3), *(replace(costs, stage_scale=scale) for scale in end)]


def _lowered_bs(schedule: Schedule) -> list[int]:
    """Per rank, the B passes the engine runs (the lowering fuses a B right before its own W where no gradient leaves)."""
    return [sum(a.kind is Kind.B for a in actions) for actions in lowered_orders(schedule)]


@pytest.mark.parametrize("costs", COSTS, ids=("equal", "uneven", "slow-links"))
@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_fusing_never_lengthens_the_step_nor_adds_memory_and_keeps_the_order(name: str, p: int, m: int, costs: Costs) -> None:
    schedule = generate(name, p, m, costs=costs)
    fused = fuse_idle_w(schedule, costs=costs)
    validate(fused)
    for profile in _profiles(costs, schedule.num_model_stages):
        assert simulate(fused, profile).makespan <= simulate(schedule, profile).makespan + 1e-9, profile
    for kept in (0.0, 0.5, 1.0):
        before, after = simulate(schedule, costs, kept_until_w=kept), simulate(fused, costs, kept_until_w=kept)
        assert all(a <= b + 1e-9 for a, b in zip(after.peak_memory, before.peak_memory))
    gone = set(_split_units(schedule)) - set(_split_units(fused))
    assert fused.params.get("fused_w", 0) == len(gone)
    for rank, (old, new) in enumerate(zip(schedule.ranks, fused.ranks)):
        # Each fused unit's BW takes its B's place; every other pass keeps its order.
        expected = [replace(a, kind=Kind.BW) if a.kind is Kind.B and a.unit in gone else a
                    for a in old if not (a.kind is Kind.W and a.unit in gone)]
        assert list(new) == expected, f"rank {rank}"


@pytest.mark.parametrize("costs", COSTS[:2], ids=("equal", "uneven"))
@pytest.mark.parametrize(("name", "p", "m"), [("zb-h1", 2, 8), ("zb-h2", 3, 6), ("zb-h2", 4, 8), ("v-zb", 2, 8), ("v-half", 3, 6)])
def test_every_w_left_apart_fills_a_bubble(name: str, p: int, m: int, costs: Costs) -> None:
    """What stays split is needed: fusing any one more unit, simulated from scratch, lengthens the step under
    one of the profiles (the incremental re-timing refused nothing the full simulator would have taken)."""
    schedule = generate(name, p, m, costs=costs)
    fused = fuse_idle_w(schedule, costs=costs)
    profiles = _profiles(costs, schedule.num_model_stages)
    assert _split_units(fused), "the bubbles need some W"
    for unit in _split_units(fused):
        one_more = _fuse_one(fused, unit)
        assert any(simulate(one_more, c).makespan > simulate(schedule, c).makespan + 1e-9 for c in profiles), unit


def test_fusion_reaches_stages_whose_gradient_leaves_the_rank_and_keeps_the_step() -> None:
    """The lowering already fused a B right before its own W where no gradient leaves the rank (the first
    stage): the new fusions are elsewhere, where a whole W delays a gradient another rank waits for."""
    for name, p in (("zb-h1", 2), ("zb-h2", 2), ("zb-h2", 4), ("v-zb", 4)):
        schedule = generate(name, p, 8)
        fused = fuse_idle_w(schedule)
        before, after = _lowered_bs(schedule), _lowered_bs(fused)
        assert all(a <= b for a, b in zip(after, before)) and sum(after) < sum(before), (name, p, before, after)
        assert any(a < b for r, (a, b) in enumerate(zip(after, before)) if r > 0), (name, p, before, after)
        assert simulate(fused).makespan == pytest.approx(simulate(schedule).makespan)


def test_schedules_without_w_come_back_unchanged() -> None:
    for name in ("1f1b", "gpipe", "interleaved"):
        schedule = generate(name, 2, 8)
        assert fuse_idle_w(schedule) is schedule


def test_the_config_fuses_when_asked_for_a_named_split_schedule_only() -> None:
    apart = parse_pipeline_config({"pipeline": {"schedule": "zb-h2"}}).make_schedule(2, 8)
    fused = parse_pipeline_config({"pipeline": {"schedule": "zb-h2", "fuse_idle_w": True}}).make_schedule(2, 8)
    assert fused.params["fused_w"] > 0 and "fused_w" not in apart.params
    assert apart == generate("zb-h2", 2, 8, costs=Costs(w_memory=1.0))
    assert fused == fuse_idle_w(apart, costs=Costs(w_memory=1.0))
    with pytest.raises(ConfigError, match=r"pipeline\.fuse_idle_w is set but pipeline\.schedule is not"):
        parse_pipeline_config({"pipeline": {"fuse_idle_w": True}})
    for name in ("auto", "1f1b", "interleaved"):
        with pytest.raises(ConfigError, match=r"pipeline\.fuse_idle_w applies only to a named schedule with split backward"):
            parse_pipeline_config({"pipeline": {"schedule": name, "fuse_idle_w": True}})


def test_the_cli_shows_the_fused_order_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "-s", "zb-h2", "-p", "2", "-m", "8", "--fuse-idle-w"]) == 0
    assert Schedule.from_json(capsys.readouterr().out) == fuse_idle_w(generate("zb-h2", 2, 8))
    assert main(["simulate", "-s", "zb-h2", "-p", "2", "-m", "8", "--fuse-idle-w"]) == 0
    count = fuse_idle_w(generate("zb-h2", 2, 8)).params["fused_w"]
    assert f"{count} units' W fill no bubble and run fused with their B" in capsys.readouterr().out.splitlines()[0]
    assert main(["simulate", "-s", "zb-h2", "-p", "2", "-m", "8"]) == 0
    assert "fused" not in capsys.readouterr().out.splitlines()[0]


def test_a_spent_budget_stops_trying_and_what_fused_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = generate("v-zb", 4, 16)
    full = fuse_idle_w(schedule)
    monkeypatch.setattr(fuse_w, "_BUDGET", 300)
    cut = fuse_idle_w(schedule)
    validate(cut)
    assert cut.params.get("fused_w", 0) < full.params["fused_w"]
    for profile in _profiles(Costs(), schedule.num_model_stages):
        assert simulate(cut, profile).makespan <= simulate(schedule, profile).makespan + 1e-9
