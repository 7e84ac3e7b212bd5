"""The lowering passes that place data-parallel work, and the ZeRO config rule (pure)."""
from __future__ import annotations

import pytest

from ds_vshape.runtime.zero.zero import check_zero_config
from ds_vshape.schedules import generate, get_info
from ds_vshape.schedules.lowering import add_param_gathers, add_stage_reduces, lower
from ds_vshape.schedules.ops import BACKWARDS, COMPUTE, Op, OpKind


def _kinds(ops: list[Op], *kinds: OpKind) -> list[str]:
    return [f"{op.kind.value}:{op.stage}" for op in ops if op.kind in kinds]


SPLIT = ["zb-h1", "zb-h2", "zb-auto", "v-zb", "v-half", "v-min", "v-adaptive"]  # split backward: W passes of their own


@pytest.mark.parametrize("name", ["1f1b", "breadth-first", "interleaved", *SPLIT])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8)])
def test_each_local_stage_is_reduced_once_right_after_its_last_backward(name: str, p: int, m: int) -> None:
    """Under split backward that is after the stage's last W: its weight gradients are final only there."""
    schedule = generate(name, p, m)
    for rank in range(p):
        ops = lower(schedule, rank)
        reduces = [i for i, op in enumerate(ops) if op.kind is OpKind.REDUCE_STAGE_GRADS]
        stages = sorted(s for s in range(schedule.num_model_stages) if schedule.stage_to_rank[s] == rank)
        assert sorted(ops[i].stage for i in reduces) == stages
        for i in reduces:
            stage = ops[i].stage
            last = max(j for j, op in enumerate(ops) if op.kind in BACKWARDS and op.stage == stage)
            assert all(op.kind not in COMPUTE for op in ops[last + 1:i]), (name, rank, stage)


def test_stage_reduce_pass_alone() -> None:
    ops = [Op(OpKind.FORWARD, 0, 0), Op(OpKind.BACKWARD_INPUT, 0, 0), Op(OpKind.BACKWARD_WEIGHT, 0, 0), Op(OpKind.SEND_GRAD, 0, 0)]
    assert _kinds(add_stage_reduces(ops), OpKind.BACKWARD_WEIGHT, OpKind.REDUCE_STAGE_GRADS) == [
        "backward_weight:0", "reduce_stage_grads:0"]


@pytest.mark.parametrize("m", [4, 8, 16])
def test_breadth_first_gathers_each_stage_once_per_direction_whatever_m(m: int) -> None:
    schedule = generate("breadth-first", 2, m)
    ops = lower(schedule, 0)
    # Rank 0 holds stages 0 and 2: s0 forward, s2 forward+backward (one run across the turn), s0 backward.
    assert _kinds(ops, OpKind.GATHER_PARAMS, OpKind.RELEASE_PARAMS) == [
        "gather_params:0", "release_params:0", "gather_params:2", "release_params:2", "gather_params:0", "release_params:0"]


@pytest.mark.parametrize("name", ["1f1b", "breadth-first", "interleaved", *SPLIT])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_gathers_and_releases_pair_up_around_every_pass(name: str, p: int, m: int) -> None:
    """Every pass, W included, runs while its stage's weights are gathered (ZeRO-3)."""
    schedule = generate(name, p, m)
    for rank in range(p):
        held: set[int] = set()
        for op in lower(schedule, rank):
            if op.kind is OpKind.GATHER_PARAMS:
                assert op.stage not in held
                held.add(op.stage)
            elif op.kind is OpKind.RELEASE_PARAMS:
                held.remove(op.stage)
            elif op.kind in COMPUTE:
                assert op.stage in held, (name, rank, str(op))
        assert not held


def test_param_gather_pass_alone_turns_without_release() -> None:
    ops = [Op(OpKind.FORWARD, 1, 0), Op(OpKind.BACKWARD, 1, 0), Op(OpKind.FORWARD, 0, 1), Op(OpKind.FORWARD, 1, 1)]
    assert _kinds(add_param_gathers(ops), *COMPUTE, OpKind.GATHER_PARAMS, OpKind.RELEASE_PARAMS) == [
        "gather_params:1", "forward:1", "backward:1", "release_params:1", "gather_params:0", "forward:0", "release_params:0",
        "gather_params:1", "forward:1", "release_params:1"]


@pytest.mark.parametrize(("config", "kw", "needles"), [
    ({"zero_optimization": {"stage": 3}}, {"schedule": "zb-h1", "allowed": (0, 1, 2)}, ["stage=3", "'zb-h1'", "0, 1, 2", "ds-vshape list"]),
    ({"zero_optimization": {"stage": 3}}, {"tied": True}, ["TiedLayerSpec", "stage=2"]),
    ({"zero_optimization": {"stage": 3}}, {"seq_chunks": 2}, ["seq_chunks=2", "stage=2"]),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, {},
     ["data_types.grad_accum_dtype", "zero_optimization.stage=1"]),
])
def test_zero_config_refusals_name_the_field_and_the_fix(config: dict, kw: dict, needles: list[str]) -> None:
    args = {"schedule": "breadth-first", "allowed": (0, 1, 2, 3), "tied": False, "seq_chunks": 1, **kw}
    with pytest.raises(ValueError) as err:
        check_zero_config(config, **args)
    for needle in needles:
        assert needle in str(err.value)


def test_zero_config_accepts_what_runs() -> None:
    check_zero_config({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
                      schedule="v-half", allowed=(0, 1, 2), tied=True, seq_chunks=4)
    check_zero_config({"zero_optimization": {"stage": 3}}, schedule="breadth-first", allowed=(0, 1, 2, 3), tied=False, seq_chunks=1)
    for name in SPLIT:  # the registry's rule, as initialize applies it
        check_zero_config({"zero_optimization": {"stage": 3}}, schedule=name, allowed=get_info(name).zero_stages, tied=False,
                          seq_chunks=1)


def test_split_schedules_lower_to_separate_w_passes() -> None:
    """The checks above mean something for split schedules only if W passes survive lowering."""
    for name in SPLIT:
        schedule = generate(name, 4, 8)
        assert any(op.kind is OpKind.BACKWARD_WEIGHT for rank in range(4) for op in lower(schedule, rank)), name


def test_trace_marks_reduce_and_gather_points_at_their_passes() -> None:
    from ds_vshape.schedules import simulate
    from ds_vshape.schedules.trace_ops import data_parallel_events

    schedule = generate("breadth-first", 2, 4)
    result = simulate(schedule)
    events = data_parallel_events(result, schedule, time_unit_us=1.0)
    rank0 = [(e["name"], e["ts"]) for e in events if e["tid"] == 0]
    assert [name for name, _ in rank0] == ["gather_params s0", "release_params s0", "gather_params s2",
                                          "reduce_stage_grads s2", "release_params s2", "gather_params s0",
                                          "reduce_stage_grads s0", "release_params s0"]
    spans = {(a.kind.value, a.stage, a.micro_batch): (s, e) for s, e, a in result.timeline[0]}
    last_b_s0 = max(e for (k, st, _), (s, e) in spans.items() if st == 0 and k in ("B", "W", "BW"))
    assert dict(rank0)["reduce_stage_grads s0"] == last_b_s0  # the reduce starts when stage 0's last backward ends
    assert rank0[0][1] == min(s for (k, st, _), (s, e) in spans.items() if st == 0)
