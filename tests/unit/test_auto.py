"""``"schedule": "auto"``, pure part: candidates, measured costs, and the pick."""

from __future__ import annotations

import pytest

from ds_vshape.config import ConfigError, parse_pipeline_config
from ds_vshape.schedules import Costs, generate, get_info, schedule_names, simulate
from ds_vshape.schedules.auto import (SAFE, AutoSettings, Measured, candidates, make_chosen, measuring_schedule, peak_bytes, pick,
                                     to_costs)
from ds_vshape.schedules.placement import placement_name


def _measured(p: int, v: int, *, f: float = 1.0, b: float = 1.0, w: float = 1.0, slow: int | None = None,
              nbytes: float = 100.0) -> Measured:
    stages = p * v
    scale = [2.0 if s == slow else 1.0 for s in range(stages)]
    return Measured(tuple(f / v * k for k in scale), tuple(b / v * k for k in scale), tuple(w / v * k for k in scale),
                    (nbytes / v,) * stages)


@pytest.mark.parametrize("name", schedule_names())
def test_each_schedule_declares_the_placement_it_generates(name: str) -> None:
    info = get_info(name)
    schedule = generate(name, 4, 8)
    assert placement_name(schedule.stage_to_rank, 4) == info.placement
    assert get_info(SAFE[info.placement]).placement == info.placement


def test_candidates_share_the_placement_and_fit_m_k_and_zero() -> None:
    assert candidates(AutoSettings(placement="v"), stages=4, micro_batches=8) == ["v-zb", "v-half", "v-min", "v-adaptive"]
    linear = candidates(AutoSettings(placement="linear"), stages=4, micro_batches=4)
    assert "zb-h2" not in linear and {"1f1b", "zb-h1", "zb-auto"} <= set(linear)  # zb-h2 needs m >= 2p-1
    chunked = candidates(AutoSettings(placement="linear", seq_chunks=2), stages=4, micro_batches=8)
    assert "zb-auto" not in chunked and "zb-h1" in chunked
    only = candidates(AutoSettings(placement="v", names=("v-half", "v-min")), stages=2, micro_batches=4)
    assert only == ["v-half", "v-min"]


def test_measured_costs_keep_each_stage_and_the_slice_scale() -> None:
    costs = to_costs(_measured(2, 2, f=1.0, b=2.0, w=0.5, slow=3), chunks_per_rank=2, w_memory=0.25)
    assert costs.stage_scale is not None and costs.stage_scale[3] == pytest.approx(2 * costs.stage_scale[0])
    assert costs.w_memory == 0.25 and costs.b / costs.f == pytest.approx(2.0)
    # A chunk's pass takes what was measured for it.
    f0 = costs.duration(generate("v-half", 2, 4).ranks[0][0], chunks_per_rank=2, seq_chunks=1)
    assert f0 == pytest.approx(0.5)


def test_the_pick_is_the_fastest_simulated_schedule() -> None:
    settings = AutoSettings(placement="linear")
    measured = _measured(4, 1, w=0.5)
    choice = pick(settings, measured, stages=4, micro_batches=8)
    costs = to_costs(measured, chunks_per_rank=1, w_memory=settings.w_memory)
    times = {n: simulate(make_chosen(choice.__class__(n, 0.0, costs, None, ()), settings, stages=4, micro_batches=8), costs).makespan
             for n in candidates(settings, stages=4, micro_batches=8)}
    assert choice.predicted_s == pytest.approx(min(times.values()))
    assert choice.table[0].name == choice.name and [c.makespan for c in choice.table] == sorted(c.makespan for c in choice.table)


def test_a_memory_limit_rules_out_the_faster_schedules() -> None:
    measured = _measured(4, 1)
    free = pick(AutoSettings(placement="linear"), measured, stages=4, micro_batches=8)
    tight = pick(AutoSettings(placement="linear", memory_limit=2.0), measured, stages=4, micro_batches=8)
    # Unlimited: ZB-H1 (as fast as ZB-H2 in one step, with less memory). Within 2 M_B (200
    # bytes here) only zb-auto's greedy fits, 1F1B's p = 4 M_B does not.
    assert free.name == "zb-h1" and free.table[0].peak_bytes == 400.0
    assert tight.name == "zb-auto" and tight.predicted_s > free.predicted_s and tight.table[0].peak_bytes <= 200.0 + 1e-6
    assert all(c.fits == (c.peak_bytes <= 200.0 + 1e-6) for c in tight.table)
    in_bytes = pick(AutoSettings(placement="linear", memory_limit_bytes=200.0), measured, stages=4, micro_batches=8)
    assert in_bytes.name == tight.name


def test_when_nothing_fits_the_least_memory_runs() -> None:
    choice = pick(AutoSettings(placement="v", memory_limit_bytes=1.0), _measured(4, 2), stages=4, micro_batches=8)
    assert not any(c.fits for c in choice.table)
    assert choice.table[0].peak_bytes == min(c.peak_bytes for c in choice.table)


def test_one_slow_stage_changes_the_prediction_not_the_rules() -> None:
    settings = AutoSettings(placement="v")
    even = pick(settings, _measured(4, 2), stages=4, micro_batches=8)
    slow = pick(settings, _measured(4, 2, slow=5), stages=4, micro_batches=8)
    assert slow.predicted_s > even.predicted_s and slow.name in candidates(settings, stages=4, micro_batches=8)


def test_peak_bytes_weigh_the_simulator_count_by_stage() -> None:
    schedule = generate("1f1b", 4, 8)
    assert peak_bytes(schedule, (10.0,) * 4, kept_until_w=0.0) == tuple(10.0 * x for x in simulate(schedule, Costs()).peak_memory)
    assert peak_bytes(schedule, (10.0, 0.0, 0.0, 0.0), kept_until_w=0.0)[0] == 40.0


def test_auto_config_starts_with_the_safe_schedule() -> None:
    vs = parse_pipeline_config({"pipeline": {"schedule": "auto", "auto_placement": "linear", "seq_chunks": 2}})
    assert vs.first_schedule == "zb-h1" and vs.make_schedule(2, 4).seq_chunks == 2
    settings = vs.auto_settings(zero_stage=1, stages=2, micro_batches=4)
    assert settings.placement == "linear" and settings.warmup_steps == 2 and settings.zero_stage == 1
    assert settings.safe == "zb-h1" and settings.warmup_limit is None
    assert parse_pipeline_config({"pipeline": {"schedule": "auto"}}).make_schedule(2, 4).name == "v-min"


@pytest.mark.parametrize(("placement", "limit", "measured_under"),
                         [("linear", 2.0, "zb-auto"), ("linear", 4.0, "zb-h1"), ("v", 3.0, "v-min"), ("v", 2.5, "v-min")])
def test_auto_measures_within_the_memory_limit(placement: str, limit: float, measured_under: str) -> None:
    """The measuring steps never hold more than memory_limit: above it, the placement's bounded generator runs."""
    vs = parse_pipeline_config({"pipeline": {"schedule": "auto", "auto_placement": placement, "memory_limit": limit}})
    schedule = vs.make_schedule(4, 8)
    costs = Costs(w_memory=vs.w_memory)
    assert schedule.name == measured_under and simulate(schedule, costs).max_peak_memory <= limit + 1e-9
    settings = vs.auto_settings(zero_stage=0, stages=4, micro_batches=8)
    assert settings.safe == measured_under and settings.warmup_limit == (limit if measured_under == "zb-auto" else None)


def test_the_measuring_schedule_is_worked_out_once_per_config() -> None:
    """make_schedule and auto_settings ask the same pure question: the second asking is answered from the cache."""
    measuring_schedule.cache_clear()
    vs = parse_pipeline_config({"pipeline": {"schedule": "auto", "auto_placement": "linear", "memory_limit": 2.0}})
    vs.make_schedule(4, 8)
    vs.auto_settings(zero_stage=0, stages=4, micro_batches=8)
    info = measuring_schedule.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_below_the_least_a_placement_holds_auto_measures_under_that_least() -> None:
    vs = parse_pipeline_config({"pipeline": {"schedule": "auto", "memory_limit": 1.5}})  # V: v-min holds 2 M_B at p=4
    assert vs.make_schedule(4, 8).name == "v-min"


def test_auto_refuses_a_limit_no_measuring_schedule_keeps_with_seq_chunks() -> None:
    vs = parse_pipeline_config({"pipeline": {"schedule": "auto", "auto_placement": "linear", "memory_limit": 2.0, "seq_chunks": 2}})
    with pytest.raises(ValueError, match="pipeline.memory_limit 2 M_B is below .* no memory-bounded schedule cuts sequences"):
        vs.make_schedule(4, 8)


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        ({"schedule": "v-half", "auto_warmup_steps": 3}, "auto_warmup_steps applies only"),
        ({"schedule": "auto", "chunks": 2}, "auto_placement 'looped'"),
        ({"schedule": "auto", "auto_placement": "looped", "seq_chunks": 2}, "no schedule of the 'looped' placement"),
        ({"schedule": "auto", "auto_candidates": ["1f1b"]}, "'1f1b' runs on the 'linear' placement"),
        ({"schedule": "auto", "memory_limit": 2, "memory_limit_bytes": 1e9}, "keep one"),
        ({"schedule": "auto", "auto_warmup_steps": 0}, "auto_warmup_steps"),
        ({"memory_limit_bytes": 1e9}, "pipeline.schedule is not"),
    ],
)
def test_auto_keys_name_the_field_and_the_fix(block: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_pipeline_config({"pipeline": block})
