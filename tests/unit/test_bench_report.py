"""The report's "sim as run" column simulates exactly the orders the engine executes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.report_rows import as_lowered
from ds_vshape.config import PipelineConfig
from ds_vshape.schedules import Action, Costs, Kind, Schedule, simulate
from ds_vshape.schedules.lowering import lower, merge_backward
from ds_vshape.schedules.ops import COMPUTE, OpKind

_KIND = {OpKind.FORWARD: Kind.F, OpKind.BACKWARD_INPUT: Kind.B, OpKind.BACKWARD_WEIGHT: Kind.W, OpKind.BACKWARD: Kind.BW}


def _engine_compute_order(sched: Schedule, rank: int) -> tuple[Action, ...]:
    """The compute instructions ``lower`` gives the engine, as actions (public path, not ``_plan``)."""
    return tuple(Action(_KIND[op.kind], op.stage, op.micro_batch, op.seq_chunk) for op in lower(sched, rank) if op.kind in COMPUTE)


@pytest.mark.parametrize("name", ["v-half", "v-min", "v-zb", "zb-h2", "1f1b"])
def test_sim_as_run_uses_the_engines_lowered_order(name: str) -> None:
    sched = PipelineConfig(schedule=name).make_schedule(4, 8)
    ran = as_lowered(sched)
    for rank in range(sched.stages):
        assert ran.ranks[rank] == _engine_compute_order(sched, rank)


def test_v_schedule_keeps_remote_bs_split_unlike_fuse_everything() -> None:
    """V-Half has B's directly followed by their W whose gradient leaves the rank: the engine
    keeps those split, so fusing every B (the column's old rule) is not what runs."""
    sched = PipelineConfig(schedule="v-half").make_schedule(4, 8)
    ran = as_lowered(sched)
    fuse_all = tuple(merge_backward(actions) for actions in sched.ranks)
    assert ran.ranks != fuse_all
    kinds = {a.kind for actions in ran.ranks for a in actions}
    assert Kind.B in kinds and Kind.BW in kinds  # some B's split, some fused
    costs = Costs(f=1.0, b=1.0, w=1.0)
    # Fusing a B whose gradient is sent holds the send back by W: slower here.
    assert simulate(ran, costs).makespan < simulate(replace(sched, ranks=fuse_all), costs).makespan


def test_two_steps_back_to_back_tile_zb_h2_but_not_1f1b() -> None:
    """ZB-H2 leaves no idle time between a rank's first and last pass, so with nothing holding
    the ranks at a step's end its steps tile: the second step adds exactly m x (F+B+W)."""
    from benchmarks.report_steady import two_steps
    from ds_vshape.schedules import generate, simulate

    for name, tiles in (("zb-h2", True), ("1f1b", False)):
        one = generate(name, 4, 8)
        added = simulate(two_steps(one)).makespan - simulate(one).makespan
        assert (added == 8 * 3) is tiles, (name, added)
