"""Activation offload in the simulator and in ``schedule: auto``'s pick (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from ds_vshape.config import parse_pipeline_config
from ds_vshape.schedules import Costs, generate, simulate
from ds_vshape.schedules.auto import OFFLOAD_SHARES, AutoSettings, Measured, peak_bytes, pick

W = 0.5  # what B keeps for W, of a unit


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "v-half", "v-zb"])
def test_offload_moves_device_memory_to_host(name: str) -> None:
    schedule = generate(name, 4, 8, costs=Costs(w_memory=W))
    plain = simulate(schedule, Costs(w_memory=W))
    for share in (0.5, 1.0):
        moved = simulate(schedule, Costs(w_memory=W), offload=share)
        # 1F1B at 0.5: at rank 0's peak half the units in flight are back (reloaded) or still in their forward.
        assert moved.max_peak_memory < plain.max_peak_memory or share < 1 and name == "1f1b", (name, share)
        assert max(moved.peak_host_memory) > 0 and plain.peak_host_memory == (0.0,) * 4
        assert moved.makespan == plain.makespan  # copies cost nothing at costs.copy = 0


def test_v_half_first_chunk_halves_what_each_rank_holds_up_to_b() -> None:
    """W kept nothing (w_memory 0): offloading the first chunk leaves the second chunk's units,
    one reload ahead of its backward, and the forward running."""
    schedule = generate("v-half", 4, 16)
    plain = simulate(schedule, Costs())
    half = simulate(schedule, Costs(), offload=0.5)
    onefb = simulate(generate("1f1b", 4, 16), Costs()).max_peak_memory
    assert half.max_peak_memory <= 0.5 * onefb < plain.max_peak_memory, (half.peak_memory, onefb, plain.peak_memory)


def test_slow_copies_delay_the_backward_and_only_then() -> None:
    schedule = generate("v-half", 4, 8)
    base = simulate(schedule, Costs())
    fast = simulate(schedule, Costs(copy=0.01), offload=0.5)
    slow = simulate(schedule, Costs(copy=20.0), offload=0.5)
    assert fast.makespan == pytest.approx(base.makespan) and slow.makespan > base.makespan
    # Each offloaded unit's backward starts after its reload (one copy of its share) had time.
    first = {a.unit: end for end, a in ((e, a) for s, e, a in slow.timeline[0]) if a.kind.value == "F"}
    for start, _end, a in slow.timeline[0]:
        if a.kind.value == "B" and a.stage == 0:
            assert start >= first[a.unit] + 2 * 20.0 / 2 - 1e-9  # out and back, 1/v = 0.5 M_B each way


def test_peak_bytes_follows_the_simulator_with_offload() -> None:
    schedule = generate("v-half", 2, 4, costs=Costs(w_memory=W))
    for share in (0.0, 0.5, 1.0):
        got = peak_bytes(schedule, (10.0,) * 4, kept_until_w=W, offload=share)
        want = simulate(schedule, Costs(w_memory=W), offload=share).peak_memory
        assert got == pytest.approx(tuple(10.0 * 2 * x for x in want))  # a stage is 1/v of M_B


def _measured(copy: float) -> Measured:
    return Measured((0.5,) * 8, (0.5,) * 8, (0.5,) * 8, (50.0,) * 8, copy=copy)


def test_auto_offloads_under_a_tight_limit_when_copies_are_measured() -> None:
    settings = AutoSettings(placement="v", memory_limit=1.5, offload=None)
    choice = pick(settings, _measured(1e-4), stages=4, micro_batches=8)
    assert choice.offload in OFFLOAD_SHARES and choice.offload > 0 and choice.table[0].fits
    assert choice.table[0].peak_bytes <= 1.5 * 100 + 1e-6
    assert pick(settings, _measured(0.0), stages=4, micro_batches=8).offload == 0  # no copy rate: no offload
    fixed = pick(dataclasses.replace(settings, offload=0.25), _measured(1e-4), stages=4, micro_batches=8)
    assert {c.offload for c in fixed.table} == {0.25}
    assert pick(AutoSettings(placement="v", offload=None), _measured(1e-4), stages=4, micro_batches=8).offload == 0  # no limit
    assert pick(AutoSettings(placement="v", memory_limit=1.5), _measured(1e-4), stages=4, micro_batches=8).offload == 0


def test_auto_picks_offload_only_when_asked() -> None:
    def settings(block: dict) -> AutoSettings:
        return parse_pipeline_config({"pipeline": {"schedule": "auto", **block}}).auto_settings(
            zero_stage=0, stages=4, micro_batches=8)
    assert settings({"memory_limit": 2}).offload == 0.0
    assert settings({"memory_limit": 2, "offload": "auto"}).offload is None
    assert settings({"memory_limit": 2, "offload": 0.5}).offload == 0.5
    assert parse_pipeline_config({"pipeline": {"schedule": "auto", "offload": "auto"}}).offload_share == 0.0
    with pytest.raises(ValueError, match="offload 'auto' applies only with"):
        parse_pipeline_config({"pipeline": {"schedule": "v-half", "offload": "auto"}})


def test_cli_simulates_offload(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_vshape.cli import main

    assert main(["simulate", "-s", "v-half", "-p", "4", "-m", "8", "--offload", "0.5", "--t-copy", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "offload 0.5 (copy 0.5 per M_B one way): device peak per rank 1.00 1.50 2.00 2.00 M_B" in out
    assert "peak memory (M_B, busiest rank)   2.00   4.00  0.50x" in out
