"""Interleaved (depth-first) and breadth-first on looped placement."""

from __future__ import annotations

import pytest

from ds_vshape.schedules import Costs, Kind, generate, get_info, looped, schedule_names, simulate

UNIT = Costs(f=1, b=1, w=1)
PS = range(2, 9)
NAMES = ("interleaved", "breadth-first")


def _bound(p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", PS)
def test_bubble_bound(name: str, p: int, v: int) -> None:
    # the bound needs m >= p for both: below, rank 0 waits at each loop for micro-batch 0
    for m in range(p, 4 * p + 1):
        result = simulate(generate(name, p, m, chunks=v), UNIT)
        assert result.bubble_rate <= _bound(p, v, m) + 1e-9, (p, m, result.bubble_rate)


@pytest.mark.parametrize("name", NAMES)
def test_bubble_is_exactly_the_bound_when_p_divides_m(name: str) -> None:
    for p, v in ((4, 2), (8, 4)):
        m = 2 * p
        assert simulate(generate(name, p, m, chunks=v), UNIT).bubble_rate == pytest.approx(_bound(p, v, m))


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", PS)
def test_validates_from_the_minimum_to_4p(name: str, p: int, v: int) -> None:
    low = get_info(name).min_micro_batches(p, v, 1)
    for m in range(low, 4 * p + 1):
        schedule = generate(name, p, m, chunks=v)  # generate validates
        assert schedule.chunks_per_rank == v
        assert schedule.stage_to_rank == looped(p, v)
        assert all(a.kind in (Kind.F, Kind.BW) for _, _, a in schedule.actions())


def test_min_micro_batches() -> None:
    assert get_info("interleaved").min_micro_batches(4, 2, 1) == 4
    assert get_info("breadth-first").min_micro_batches(4, 2, 1) == 1
    with pytest.raises(ValueError, match="at least 4 micro-batches"):
        generate("interleaved", 4, 3)
    from ds_vshape.schedules.generators.looped import interleaved

    with pytest.raises(ValueError, match="at least p = 4"):
        interleaved(4, 3)


def test_registry_flags() -> None:
    assert get_info("interleaved").fixed_chunks is None
    assert get_info("breadth-first").fixed_chunks is None
    # ZeRO-3 with every schedule, split backward included (the registry, which initialize reads).
    for name in schedule_names():
        assert set(get_info(name).zero_stages) == {0, 1, 2, 3}, name
    assert generate("interleaved", 4, 8).chunks_per_rank == 2  # default v


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for p in PS:
        for m in range(p, 2 * p + 2):
            assert generate("interleaved", p, m, chunks=1).ranks == generate("1f1b", p, m).ranks


def test_interleaved_follows_megatron_table_when_p_divides_m() -> None:
    # groups of p micro-batches through chunk 0 then chunk 1; warm-up 2(p-r-1) + (v-1)p
    p, v, m = 4, 2, 8
    schedule = generate("interleaved", p, m, chunks=v)
    for r in range(p):
        fwd = [(a.stage, a.micro_batch) for a in schedule.ranks[r] if a.kind is Kind.F]
        expected = [(c * p + r, i) for low in (0, 4) for c in range(v) for i in range(low, low + 4)]
        assert fwd == expected
        first_bw = next(pos for pos, a in enumerate(schedule.ranks[r]) if a.kind is Kind.BW)
        assert first_bw == 2 * (p - r - 1) + (v - 1) * p + 1
        assert schedule.ranks[r][first_bw].stage == (v - 1) * p + r


def test_interleaved_memory_below_breadth_first() -> None:
    p, v, m = 4, 2, 16
    depth = simulate(generate("interleaved", p, m, chunks=v)).max_peak_memory
    breadth = simulate(generate("breadth-first", p, m, chunks=v)).max_peak_memory
    assert depth < breadth == m


def test_breadth_first_runs_each_chunk_for_all_micro_batches() -> None:
    p, v, m = 3, 3, 5
    schedule = generate("breadth-first", p, m, chunks=v)
    for r, actions in enumerate(schedule.ranks):
        stages = [a.stage for a in actions]
        fwd = [c * p + r for c in range(v) for _ in range(m)]
        bwd = [c * p + r for c in reversed(range(v)) for _ in range(m)]
        assert stages == fwd + bwd
        # one stretch per chunk (the last chunk's forward and backward join): its weights are
        # needed once per step, and its gradients are complete at the end of its stretch
        assert sum(1 for i in range(1, len(stages)) if stages[i] != stages[i - 1]) == 2 * (v - 1)
