"""Cutting layers into stages from measured costs (``partition_method: profile``), pure part."""

from __future__ import annotations

import itertools
import random

import pytest

from ds_vshape.schedules import Costs, generate, linear, looped, vshape
from ds_vshape.schedules.partition import LayerCost, cut_layers, pool_alike, rank_loads, stage_inflight


def _brute(costs: list[LayerCost], placement: tuple[int, ...], held: tuple[float, ...], slack: float) -> tuple[float, float]:
    """Every cut: the lexicographic optimum (busiest time within the slack, then memory, then time)."""
    n, stages = len(costs), len(placement)
    loads = [rank_loads((0, *c, n), costs, placement, inflight=held) for c in itertools.combinations(range(1, n), stages - 1)]
    fastest = min(max(t) for t, _ in loads)
    limit = fastest * (1 + slack) + 1e-12 * max(1.0, fastest)
    leanest = min(max(m) for t, m in loads if max(t) <= limit)
    return min(max(t) for t, m in loads if max(t) <= limit and max(m) <= leanest * (1 + 1e-9) + 1e-9), leanest


PLACEMENTS = {"linear": lambda p: linear(p), "v": lambda p: vshape(p), "looped": lambda p: looped(p, 2)}


@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_the_cut_is_the_least_busiest_rank_of_all_cuts(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(25):
        p = rng.choice((2, 3))
        placement = PLACEMENTS[kind](p)
        n = rng.randint(len(placement), len(placement) + 4)
        costs = [LayerCost(rng.choice((1, 2, 5)) * rng.random(), 10 * rng.random(), 5 * rng.random()) for _ in range(n)]
        held = tuple(float(rng.choice((1, 2, 3))) for _ in placement)
        slack = rng.choice((0.0, 0.05, 0.3))
        cut = cut_layers(costs, placement, inflight=held, time_slack=slack)
        time, memory = _brute(costs, placement, held, slack)
        assert cut.busiest_time == pytest.approx(time, rel=1e-9), (kind, costs, held, slack, cut)
        assert cut.busiest_memory == pytest.approx(memory, rel=1e-9), (kind, costs, held, slack, cut)
        assert len(cut.parts) == len(placement) + 1 and all(a < b for a, b in zip(cut.parts, cut.parts[1:]))


def test_v_placement_gives_the_rank_with_embedding_and_head_fewer_blocks() -> None:
    # Embedding, 10 equal blocks, a head with its logits and loss: V puts the first and the
    # last stage on rank 0, so rank 0 takes fewer blocks. A uniform cut would give rank 0
    # embedding + 2 blocks + 2 blocks + head, i.e. 4 + 3 + 3 = 10 against 3 blocks elsewhere.
    costs = [LayerCost(3.0)] + [LayerCost(1.0)] * 10 + [LayerCost(3.0)]
    cut = cut_layers(costs, vshape(3))
    assert cut.busiest_time == pytest.approx(min(max(t) for t in _all_rank_times(costs, vshape(3))))
    assert cut.rank_time[0] <= 7.0 and cut.busiest_time <= 7.0, cut
    assert rank_loads(cut.parts, costs, vshape(3))[0] == cut.rank_time


def _all_rank_times(costs: list[LayerCost], placement: tuple[int, ...]) -> list[tuple[float, ...]]:
    n = len(costs)
    return [rank_loads((0, *c, n), costs, placement)[0] for c in itertools.combinations(range(1, n), len(placement) - 1)]


def test_memory_decides_between_cuts_of_equal_time() -> None:
    # Two cuts of equal time: the second layer's activation is large, and stage 0 holds two
    # micro-batches (1F1B at p=2), so it goes to stage 1, which holds one.
    costs = [LayerCost(1.0, 0.0), LayerCost(0.0, 100.0), LayerCost(1.0, 0.0)]
    cut = cut_layers(costs, linear(2), inflight=(2.0, 1.0), time_slack=0.0)
    assert cut.parts == (0, 1, 3) and cut.rank_memory == (0.0, 100.0)


def test_time_slack_trades_a_little_time_for_memory() -> None:
    # Stage 0 holds two micro-batches: the fastest cut (2 + 2) puts 200 bytes on rank 0; one
    # layer fewer there costs rank 1 half again the time but holds only 150.
    costs = [LayerCost(1.0, 50.0), LayerCost(1.0, 50.0), LayerCost(1.1, 50.0), LayerCost(1.0, 50.0)]
    fast = cut_layers(costs, linear(2), inflight=(2.0, 1.0), time_slack=0.0)
    lean = cut_layers(costs, linear(2), inflight=(2.0, 1.0), time_slack=0.5)
    assert fast.parts == (0, 2, 4) and fast.busiest_time == pytest.approx(2.1) and fast.busiest_memory == 200.0
    assert lean.parts == (0, 1, 4) and lean.busiest_memory == 150.0 and lean.busiest_time == pytest.approx(3.1)


def test_stage_inflight_follows_the_schedule() -> None:
    # 1F1B: rank r holds p - r micro-batches at its peak. V-Min's stages are half as large, and
    # rank 0's two hold floor((p+4)/3) = 2 M_B worth at p=4, half of 1F1B's 4.
    assert stage_inflight(generate("1f1b", 4, 8)) == (4.0, 3.0, 2.0, 1.0)
    vmin = stage_inflight(generate("v-min", 4, 8))
    assert len(vmin) == 8 and (vmin[0] + vmin[7]) / 2 <= 2.0
    # Split backward with W late: what B keeps until W counts too.
    assert sum(stage_inflight(generate("zb-h2", 2, 4), kept_until_w=1.0)) >= sum(stage_inflight(generate("zb-h2", 2, 4)))


@pytest.mark.parametrize(
    ("costs", "placement", "kwargs", "needle"),
    [
        ([LayerCost(1.0)] * 3, vshape(2), {}, "3 layers cannot be cut into 4"),
        ([LayerCost(1.0)] * 4, (0, 2), {}, "every rank 0..p-1"),
        ([LayerCost(1.0)] * 4, linear(2), {"inflight": (1.0,)}, "inflight has 1 entries"),
        ([LayerCost(1.0)] * 4, linear(2), {"time_slack": -1.0}, "time_slack"),
    ],
)
def test_bad_input_says_what_to_change(costs: list[LayerCost], placement: tuple[int, ...], kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        cut_layers(costs, placement, **kwargs)


def test_layer_costs_must_be_numbers_at_least_zero() -> None:
    with pytest.raises(ValueError, match="LayerCost.time"):
        LayerCost(float("nan"))


def test_alike_layers_share_their_median_time() -> None:
    costs = [LayerCost(1.0, 5.0), LayerCost(2.9, 8.0), LayerCost(3.3, 8.0), LayerCost(3.0, 8.0), LayerCost(7.0, 1.0)]
    pooled = pool_alike(costs, [None, "block", "block", "block", None])
    assert [c.time for c in pooled] == [1.0, 3.0, 3.0, 3.0, 7.0]
    assert [c.activation_bytes for c in pooled] == [c.activation_bytes for c in costs]
    with pytest.raises(ValueError, match="3 costs but 2 kinds"):
        pool_alike(costs[:3], [None, None])


def test_pooling_lets_memory_decide_between_alike_blocks() -> None:
    """The recipe's tiny Llama as profile measured it once (benchmarks/repro_profile_slack.py):
    8 identical decoder blocks whose times differ by noise only. Cut for v-half at p=4, the noise
    puts rank 0's blocks in stage 0 (5 micro-batches held) and rank 0 holds 14.2 MiB; pooled,
    they go to stage 7 (1 held) and the busiest rank is one of the others."""
    kib = 1024
    blocks_ms = (3.12, 2.86, 3.25, 3.19, 3.08, 3.09, 3.33, 3.21)
    costs = ([LayerCost(0.47e-3, 2 * kib, 64 * kib)] + [LayerCost(t * 1e-3, 1358 * kib, 196 * kib) for t in blocks_ms]
             + [LayerCost(0.70e-3, 451 * kib, 64 * kib)])
    schedule = generate("v-half", 4, 8, costs=Costs(w_memory=0.5))
    inflight = stage_inflight(schedule, kept_until_w=0.5)
    noisy = cut_layers(costs, schedule.stage_to_rank, inflight=inflight)
    pooled = cut_layers(pool_alike(costs, [None] + ["block"] * 8 + [None]), schedule.stage_to_rank, inflight=inflight)
    assert noisy.rank_memory[0] > 1.5 * max(noisy.rank_memory[1:])
    assert pooled.rank_memory[0] < 0.5 * max(pooled.rank_memory[1:])
    assert max(pooled.rank_memory) < 0.6 * max(noisy.rank_memory)
