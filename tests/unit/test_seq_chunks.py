"""Sequence chunks with every schedule that accepts them, and the seq-chunk-order rule."""

from __future__ import annotations

import pytest

from ds_vshape.schedules import Costs, Kind, Schedule, ScheduleError, generate, get_info, schedule_names, simulate, validate
from ds_vshape.schedules.lowering import programs
from ds_vshape.schedules.p2p_check import check_transfers

UNIT = Costs(f=1, b=1, w=1)
CHUNKED = ("1f1b", "zb-h1", "zb-h2", "v-half", "v-zb", "v-min", "seq1f1b")
EPS = 1e-9


def _m_values(name: str, p: int) -> list[int]:
    low = get_info(name).min_micro_batches(p, get_info(name).chunks(None), 2)
    return sorted({low, low + 1, 2 * p, 3 * p})


def test_registry_flags_say_which_schedules_cut_sequences() -> None:
    assert {n for n in schedule_names() if get_info(n).seq_chunks} == set(CHUNKED)
    assert generate("1f1b", 4, 4).seq_chunks == 1  # no chunks unless asked: backward compatible
    assert generate("seq1f1b", 4, 4).seq_chunks == 2
    with pytest.raises(ValueError, match="seq_chunks applies to: .*zb-h1"):
        generate("zb-auto", 4, 8, seq_chunks=2)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("name", CHUNKED)
def test_chunked_schedules_validate_and_keep_nccl_rules(name: str, k: int) -> None:
    for p in (2, 3, 4, 6):
        for m in _m_values(name, p):
            schedule = generate(name, p, m, seq_chunks=k)  # generate validates
            assert schedule.seq_chunks == k
            for train in (True, False):
                check_transfers(programs(schedule, train=train))


@pytest.mark.parametrize("name", CHUNKED)
def test_chunk_order_on_every_stage(name: str) -> None:
    k, m = 3, 8
    schedule = generate(name, 4, m, seq_chunks=k)
    for actions in schedule.ranks:
        for stage in {a.stage for a in actions}:
            fwd = [(a.micro_batch, a.seq_chunk) for a in actions if a.stage == stage and a.kind is Kind.F]
            bwd = [(a.micro_batch, a.seq_chunk) for a in actions if a.stage == stage and a.kind.is_backward]
            for i in range(m):
                assert [j for mb, j in fwd if mb == i] == list(range(k))
                assert [j for mb, j in bwd if mb == i] == list(reversed(range(k)))


@pytest.mark.parametrize("w_memory", [0.0, 0.5])
@pytest.mark.parametrize("name", CHUNKED)
def test_chunks_cut_bubble_and_never_add_memory(name: str, w_memory: float) -> None:
    costs = Costs(f=1, b=1, w=1, w_memory=w_memory)
    for p in (2, 4, 8):
        m = max(2 * p, get_info(name).min_micro_batches(p, 1, 1))
        plain = simulate(generate(name, p, m, seq_chunks=1, costs=costs), costs)
        for k in (2, 4):
            chunked = simulate(generate(name, p, m, seq_chunks=k, costs=costs), costs)
            assert chunked.bubble_rate < plain.bubble_rate - EPS, (name, p, k)
            assert chunked.max_peak_memory <= plain.max_peak_memory + EPS, (name, p, k)


@pytest.mark.parametrize("k", [2, 4])
def test_1f1b_with_chunks_reaches_the_seq1f1b_bound(k: int) -> None:
    for p in range(2, 9):
        for m in range(1, 3 * p + 1):
            result = simulate(generate("1f1b", p, m, seq_chunks=k), UNIT)
            assert result.bubble_rate <= (p - 1) / (k * m + p - 1) + EPS, (p, m)
            assert result.bubble_rate < simulate(generate("1f1b", p, m), UNIT).bubble_rate
            assert result.max_peak_memory <= 1 + (p - 1) / k + EPS, (p, m)


def test_zb_keeps_its_w_placement_with_chunks() -> None:
    # ZB-H1: rank r holds back its first r W passes, so r B passes come before the first W.
    p, m, k = 4, 8, 2
    schedule = generate("zb-h1", p, m, seq_chunks=k)
    for r, actions in enumerate(schedule.ranks):
        first_w = next(pos for pos, a in enumerate(actions) if a.kind is Kind.W)
        assert sum(a.kind is Kind.B for a in actions[:first_w]) == r + 1


def test_v_schedules_keep_v_placement_with_chunks() -> None:
    for name in ("v-half", "v-zb"):
        schedule = generate(name, 4, 8, seq_chunks=2)
        assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0) and schedule.uses_split_backward


def test_seq_weights_keep_orders_valid() -> None:
    costs = Costs(seq_weights=(4.0, 3.0, 2.0, 1.0))
    for name in CHUNKED:
        schedule = generate(name, 4, 8, seq_chunks=4)
        assert simulate(schedule, costs).makespan > 0


# ---- the seq-chunk-order rule ------------------------------------------------------------
def _two_stage(rank0: str, rank1: str) -> Schedule:
    return Schedule.from_text([rank0, rank1], name="hand", micro_batches=1, stage_to_rank=[0, 1], seq_chunks=2)


def test_backward_of_an_earlier_chunk_first_is_named() -> None:
    bad = _two_stage("0F0 0F0.1 0BW0 0BW0.1", "1F0 1F0.1 1BW0.1 1BW0")
    with pytest.raises(ScheduleError) as err:
        validate(bad)
    assert err.value.rule == "seq-chunk-order" and (err.value.rank, err.value.pos) == (0, 3)
    text = str(err.value)
    assert "rank 0, step 3" in text and "[seq-chunk-order]" in text and "move 0BW0.1 before step 2" in text


def test_split_backward_order_is_checked_too() -> None:
    bad = _two_stage("0F0 0F0.1 0BW0.1 0BW0", "1F0 1F0.1 1B0 1W0 1B0.1 1W0.1")
    with pytest.raises(ScheduleError, match=r"rank 1, step 4: \[seq-chunk-order\]") as err:
        validate(bad)
    assert err.value.rule == "seq-chunk-order" and err.value.rank == 1


def test_forward_out_of_chunk_order_is_named() -> None:
    bad = _two_stage("0F0.1 0F0 0BW0.1 0BW0", "1F0 1F0.1 1BW0.1 1BW0")
    with pytest.raises(ScheduleError, match=r"rank 0, step 1: \[seq-chunk-order\].*ascending") as err:
        validate(bad)
    assert err.value.rule == "seq-chunk-order"


def test_w_order_is_free() -> None:
    good = _two_stage("0F0 0F0.1 0BW0.1 0BW0", "1F0 1F0.1 1B0.1 1B0 1W0 1W0.1")
    assert validate(good) is good
