"""IR text form, validator messages and the simulator's closed-form baselines."""

from __future__ import annotations

import copy
import pickle
import time

import pytest

from ds_vshape.schedules import (
    Action,
    Costs,
    Kind,
    Schedule,
    ScheduleError,
    generate,
    linear,
    parse_action,
    schedule_names,
    simulate,
    validate,
)

# ---- action text --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1F3", Action(Kind.F, 1, 3)),
        ("0B2", Action(Kind.B, 0, 2)),
        ("0W2", Action(Kind.W, 0, 2)),
        ("3BW0", Action(Kind.BW, 3, 0)),
        ("2F1.3", Action(Kind.F, 2, 1, 3)),
        ("12BW34.5", Action(Kind.BW, 12, 34, 5)),
    ],
)
def test_action_text_round_trip(text: str, expected: Action) -> None:
    assert parse_action(text) == expected
    assert str(expected) == text
    assert parse_action(str(expected)) == expected


def test_seq_chunk_zero_is_implicit() -> None:
    assert str(Action(Kind.F, 2, 1, 0)) == "2F1"
    assert parse_action("2F1.0") == Action(Kind.F, 2, 1)


@pytest.mark.parametrize("text", ["", "F3", "1X3", "1F", "1F3.", "a1F3", "1FW3", "-1F3", "1F3.2.1", "1 F3"])
def test_parse_errors_name_the_bad_text(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse action") as info:
        parse_action(text)
    assert repr(text.strip()) in str(info.value)
    assert "1F3" in str(info.value)  # the message shows the expected form


def test_action_dict_round_trip() -> None:
    action = parse_action("2F1.3")
    assert Action.from_dict(action.to_dict()) == action


# ---- validator messages -------------------------------------------------------------------


def _two_rank(lines: list[str], *, micro_batches: int = 2) -> Schedule:
    return Schedule.from_text(lines, name="broken", micro_batches=micro_batches, stage_to_rank=linear(2))


def _error_of(schedule: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    return info.value


def test_valid_hand_written_schedule_passes() -> None:
    schedule = _two_rank(["0F0 0F1 0BW0 0BW1", "1F0 1BW0 1F1 1BW1"])
    assert validate(schedule) is schedule


def test_ownership_error_names_rank_step_rule_and_grid() -> None:
    err = _error_of(_two_rank(["0F0 0F1 0BW0 0BW1", "1F0 0B0 1BW0 1F1 1BW1"]))
    text = str(err)
    assert (err.rule, err.rank, err.pos) == ("ownership", 1, 1)
    assert "rank 1, step 1" in text and "[ownership]" in text
    assert "rank 0: 0F0" in text and "[0B0]" in text  # the grid, with the culprit bracketed


def test_duplicate_action_is_exactly_once_error() -> None:
    err = _error_of(_two_rank(["0F0 0F0 0F1 0BW0 0BW1", "1F0 1BW0 1F1 1BW1"]))
    assert err.rule == "exactly-once"
    assert err.rank == 0 and err.pos == 0
    assert "appears 2 times" in str(err)
    assert "rank 1: 1F0" in str(err)


def test_mixed_backward_forms_rejected() -> None:
    err = _error_of(_two_rank(["0F0 0F1 0BW0 0BW1", "1F0 1BW0 1B0 1W0 1F1 1BW1"]))
    assert err.rule in ("backward-form", "exactly-once")
    assert "rank 1" in str(err)


def test_missing_weight_grad_is_backward_form_error() -> None:
    err = _error_of(_two_rank(["0F0 0F1 0BW0 0BW1", "1F0 1B0 1F1 1BW1"]))
    assert err.rule == "backward-form"
    assert "missing W" in str(err)


def test_out_of_range_micro_batch() -> None:
    err = _error_of(_two_rank(["0F0 0F1 0F2 0BW0 0BW1", "1F0 1BW0 1F1 1BW1"]))
    assert (err.rule, err.rank, err.pos) == ("range", 0, 2)


def test_deadlock_names_the_blocked_step() -> None:
    # Rank 0 waits for the gradient of micro-batch 1 before rank 1 can get its forward.
    err = _error_of(_two_rank(["0F0 0BW1 0F1 0BW0", "1F0 1F1 1BW0 1BW1"]))
    assert err.rule == "dependency"
    assert err.rank == 0 and err.pos == 1
    assert "deadlock" in str(err) and "[0BW1]" in str(err)


# ---- simulator baselines ------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 8), (4, 16), (8, 64)])
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_baseline_bubble_is_closed_form(name: str, p: int, m: int) -> None:
    result = simulate(generate(name, p, m))
    assert result.bubble_rate == pytest.approx((p - 1) / (m + p - 1))
    assert result.makespan == pytest.approx(3 * (m + p - 1))  # F = 1, fused BW = b + w = 2
    for rate in result.bubble_rates:
        assert rate == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 16), (8, 64)])
def test_baseline_peak_memory(p: int, m: int) -> None:
    assert simulate(generate("1f1b", p, m)).peak_memory == tuple(float(p - r) for r in range(p))
    assert simulate(generate("gpipe", p, m)).peak_memory == (float(m),) * p


def test_comm_latency_lengthens_the_step() -> None:
    plain = simulate(generate("1f1b", 4, 8))
    slow = simulate(generate("1f1b", 4, 8), Costs(comm=0.5))
    assert slow.makespan > plain.makespan


def test_all_schedules_simulate_fast_at_p8_m64() -> None:
    """The issue's target is under a second for all schedules together; 5 s catches blow-ups."""
    start = time.perf_counter()
    simulated = []
    for name in schedule_names():
        try:
            schedule = generate(name, 8, 64)
        except ValueError:  # a schedule that cannot serve p=8, m=64 at its defaults
            continue
        simulate(schedule)
        simulated.append(name)
    elapsed = time.perf_counter() - start
    print(f"\ngenerate+validate+simulate of {len(simulated)} schedules at p=8, m=64: {elapsed:.3f} s")
    assert "1f1b" in simulated
    assert elapsed < 5.0


def test_a_schedules_hash_is_computed_once_and_never_travels() -> None:
    """The lowering's caches hash a schedule per lookup: its hash is kept, equal schedules hash alike,
    and a pickle or copy carries no hash (a string's hash differs between processes)."""
    one, two = generate("v-zb", 4, 8), generate("v-zb", 4, 8)
    assert one is not two and one == two and hash(one) == hash(two)
    assert one.__dict__["_hash"] == hash(one)
    assert "_hash" not in one.__getstate__()
    for clone in (pickle.loads(pickle.dumps(one)), copy.deepcopy(one), copy.copy(one)):
        assert "_hash" not in clone.__dict__ and clone == one and hash(clone) == hash(one)
    other = generate("v-zb", 4, 12)
    assert other != one and {one: 1, other: 2}[two] == 1
