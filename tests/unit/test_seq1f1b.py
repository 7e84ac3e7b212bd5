"""Seq1F1B: 1F1B over (micro-batch, sequence chunk) units."""

from __future__ import annotations

import pytest

from ds_vshape.schedules import Costs, Kind, generate, get_info, linear, simulate

UNIT = Costs(f=1, b=1, w=1)
PS = range(2, 9)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("p", PS)
def test_bubble_and_memory_bounds(p: int, k: int) -> None:
    for m in range(1, 4 * p + 1):
        result = simulate(generate("seq1f1b", p, m, seq_chunks=k), UNIT)
        assert result.bubble_rate <= (p - 1) / (k * m + p - 1) + 1e-9, (p, m)
        assert result.max_peak_memory <= 1 + (p - 1) / k + 1e-9, (p, m)


def test_bounds_are_reached_with_enough_micro_batches() -> None:
    for p, k in ((4, 2), (8, 4)):
        m = 2 * p
        result = simulate(generate("seq1f1b", p, m, seq_chunks=k), UNIT)
        assert result.bubble_rate == pytest.approx((p - 1) / (k * m + p - 1))
        assert result.max_peak_memory == pytest.approx(1 + (p - 1) / k)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("p", PS)
def test_validates_from_the_minimum_to_4p(p: int, k: int) -> None:
    low = get_info("seq1f1b").min_micro_batches(p, 1, k)
    assert low == 1
    for m in range(low, 4 * p + 1):
        schedule = generate("seq1f1b", p, m, seq_chunks=k)  # generate validates
        assert schedule.seq_chunks == k and schedule.stage_to_rank == linear(p)


def test_warmup_is_p_minus_r_minus_1_plus_k_minus_1() -> None:
    p, k, m = 4, 3, 8
    schedule = generate("seq1f1b", p, m, seq_chunks=k)
    for r, actions in enumerate(schedule.ranks):
        first_bw = next(pos for pos, a in enumerate(actions) if a.kind is Kind.BW)
        assert first_bw == (p - r - 1) + (k - 1) + 1  # warm-up, then the first steady F


def test_chunk_order_forward_up_backward_down() -> None:
    schedule = generate("seq1f1b", 3, 4, seq_chunks=4)
    for actions in schedule.ranks:
        fwd = [(a.micro_batch, a.seq_chunk) for a in actions if a.kind is Kind.F]
        bwd = [(a.micro_batch, a.seq_chunk) for a in actions if a.kind is Kind.BW]
        assert fwd == [(i, j) for i in range(4) for j in range(4)]
        assert bwd == [(i, j) for i in range(4) for j in reversed(range(4))]


def test_one_chunk_is_1f1b() -> None:
    for p in PS:
        for m in range(1, 2 * p):
            assert generate("seq1f1b", p, m, seq_chunks=1).ranks == generate("1f1b", p, m).ranks


def test_default_and_flags() -> None:
    assert generate("seq1f1b", 4, 4).seq_chunks == 2
    assert get_info("seq1f1b").seq_chunks
    with pytest.raises(ValueError, match="seq_chunks"):
        generate("interleaved", 4, 4, seq_chunks=2)


def test_seq1f1b_is_1f1b_with_chunks() -> None:
    for p, m, k in ((2, 3, 2), (4, 8, 3), (8, 5, 4)):
        assert generate("seq1f1b", p, m, seq_chunks=k).ranks == generate("1f1b", p, m, seq_chunks=k).ranks
