"""Where sequences are cut: uniform and computation-wise partitions."""

from __future__ import annotations

import pytest

from ds_vshape.schedules import Costs, generate, simulate
from ds_vshape.schedules.seq_partition import chunk_boundaries, chunk_costs, chunk_lengths, chunk_weights

MODEL = {"hidden": 4096, "heads": 32}


def _formula(s: int, end: int, *, hidden: int, heads: int, d_h: int, ffn: int) -> float:
    a = heads
    return s * end * (4 * d_h + 3) * a - s * s * (4 * d_h + 3) * a / 2 + 8 * s * hidden * a * d_h + 4 * s * hidden * ffn


@pytest.mark.parametrize(("n", "k"), [(4096, 4), (4097, 4), (10, 3), (5, 5), (1, 1)])
def test_uniform_splits_evenly(n: int, k: int) -> None:
    cuts = chunk_boundaries(n, k)
    lengths = chunk_lengths(cuts)
    assert cuts[0] == 0 and cuts[-1] == n and len(lengths) == k
    assert max(lengths) - min(lengths) <= 1 and list(lengths) == sorted(lengths, reverse=True)


@pytest.mark.parametrize(("n", "k"), [(4096, 2), (4096, 4), (8192, 8), (32768, 8), (131072, 16), (1000, 3)])
def test_compute_partition_equal_costs_later_chunks_shorter(n: int, k: int) -> None:
    dims = {"hidden": 4096, "heads": 32, "d_h": 128, "ffn": 4 * 4096}
    cuts = chunk_boundaries(n, k, mode="compute", **MODEL)
    lengths = chunk_lengths(cuts)
    assert sum(lengths) == n and cuts[-1] == n and all(s >= 1 for s in lengths)
    assert list(lengths) == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    costs = [_formula(b - a, b, **dims) for a, b in zip(cuts, cuts[1:])]
    assert max(costs) / min(costs) - 1 < 5e-3
    assert chunk_costs(cuts, **MODEL) == pytest.approx(costs)
    assert sum(costs) == pytest.approx(_formula(n, n, **dims))  # costs add up to the whole sequence


def test_compute_partition_edge_cases() -> None:
    assert chunk_boundaries(7, 7, mode="compute", **MODEL) == tuple(range(8))
    assert chunk_boundaries(9, 1, mode="compute", **MODEL) == (0, 9)
    short = chunk_lengths(chunk_boundaries(10, 4, mode="compute", hidden=64, heads=1, head_dim=64, ffn=1))
    assert sum(short) == 10 and list(short) == sorted(short, reverse=True) and min(short) >= 1
    explicit = chunk_boundaries(4096, 4, mode="compute", hidden=4096, heads=32, head_dim=128, ffn=11008)
    assert explicit != chunk_boundaries(4096, 4, mode="compute", **MODEL)  # ffn is used


def test_bad_input_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="hidden= and heads="):
        chunk_boundaries(4096, 4, mode="compute")
    with pytest.raises(ValueError, match="lower seq_chunks"):
        chunk_boundaries(3, 4)
    with pytest.raises(ValueError, match="uniform, compute"):
        chunk_boundaries(4096, 4, mode="flops")  # type: ignore[arg-type]


def test_weights_feed_the_simulator() -> None:
    uniform = chunk_weights(chunk_boundaries(8192, 4), **MODEL)
    compute = chunk_weights(chunk_boundaries(8192, 4, mode="compute", **MODEL), **MODEL)
    assert sum(uniform) == pytest.approx(1) and list(uniform) == sorted(uniform)  # later chunks cost more
    assert max(compute) - min(compute) < 1e-3
    schedule = generate("1f1b", 4, 8, seq_chunks=4)
    balanced = simulate(schedule, Costs(seq_weights=compute))
    skewed = simulate(schedule, Costs(seq_weights=uniform))
    assert balanced.makespan <= skewed.makespan + 1e-9
