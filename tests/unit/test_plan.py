"""The plan the front door hands the engine: made once, checked once, swapped whole."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest

from ds_vshape.config import PipelineConfig
from ds_vshape.runtime.program import plan as plan_module
from ds_vshape.runtime.program.instructions import IRSchedule
from ds_vshape.runtime.program.plan import EngineSettings, Plan
from ds_vshape.schedules.auto import AutoSettings
from ds_vshape.schedules import Schedule, ScheduleError, generate
from ds_vshape.schedules.lowering import programs
from ds_vshape.schedules.placement import linear

SETTINGS = EngineSettings(p2p_timeout_s=30.0)


def _plan(name: str, p: int, m: int, **pipeline: object) -> Plan:
    config = PipelineConfig(schedule=name, **pipeline)
    return Plan(config.make_schedule(p, m), partial(config.make_schedule, p), SETTINGS)


def test_a_plan_holds_every_ranks_program_of_its_schedule() -> None:
    plan = _plan("zb-h1", 4, 8)
    assert plan.schedule == generate("zb-h1", 4, 8)
    assert plan.programs == tuple(tuple(ops) for ops in programs(plan.schedule))
    assert len(plan.programs) == 4


def test_every_plan_checks_its_programs_transfers_once_when_made(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real check, recorded: each plan (the first, a ramp-up's, auto's switch) hands it its programs.
    checked: list[tuple] = []
    real = plan_module.check_transfers

    def spy(progs: tuple, **kwargs: object) -> None:
        checked.append(progs)
        real(progs, **kwargs)

    monkeypatch.setattr(plan_module, "check_transfers", spy)
    plan = _plan("zb-h2", 4, 8)
    ramped = plan.for_micro_batches(12)
    switched = ramped.switched(lambda m: generate("1f1b", 4, m), micro_batches=12)
    assert checked == [plan.programs, ramped.programs, switched.programs]


def test_the_engines_rank_program_from_the_plan_is_what_lowering_this_rank_gives() -> None:
    # The engine hands IRSchedule its plan's program of the rank instead of lowering it again.
    for name, p, m in (("1f1b", 2, 4), ("zb-h2", 4, 8), ("v-zb", 4, 8), ("seq1f1b", 2, 4)):
        plan = _plan(name, p, m)
        for rank in range(p):
            assert IRSchedule(plan.schedule, rank, lowered=plan.programs[rank]).ops == IRSchedule(plan.schedule, rank).ops


def test_a_schedule_that_cannot_run_is_refused_when_the_plan_is_made() -> None:
    # Rank 0 waits for micro-batch 1's gradient before rank 1 can have its forward.
    broken = Schedule.from_text(["0F0 0BW1 0F1 0BW0", "1F0 1F1 1BW0 1BW1"], name="broken", micro_batches=2,
                                stage_to_rank=linear(2))
    with pytest.raises(ScheduleError, match="deadlocks"):
        Plan(broken, lambda m: broken, SETTINGS)


def test_batch_ramp_up_remakes_the_same_schedule_for_the_new_micro_batch_count() -> None:
    plan = _plan("v-zb", 4, 8, w_memory=1.0)
    ramped = plan.for_micro_batches(12)
    assert ramped.schedule == PipelineConfig(schedule="v-zb", w_memory=1.0).make_schedule(4, 12)
    assert ramped.programs == tuple(tuple(ops) for ops in programs(ramped.schedule))
    assert (ramped.settings, ramped.auto, ramped.remake) == (plan.settings, plan.auto, plan.remake)
    assert plan.schedule.micro_batches == 8  # the old plan is untouched


def test_a_switched_plan_remakes_the_new_schedule_on_ramp_up() -> None:
    base = _plan("1f1b", 4, 8)
    plan = Plan(base.schedule, base.remake, SETTINGS, auto=AutoSettings())
    switched = plan.switched(lambda m: generate("zb-h2", 4, m), micro_batches=8)
    assert switched.schedule == generate("zb-h2", 4, 8)
    assert switched.for_micro_batches(16).schedule == generate("zb-h2", 4, 16)
    assert (switched.settings, switched.auto) == (plan.settings, plan.auto)


def test_a_plan_and_its_settings_are_frozen() -> None:
    plan = _plan("1f1b", 2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.schedule = generate("zb-h1", 2, 4)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.settings.offload = 0.5  # type: ignore[misc]
