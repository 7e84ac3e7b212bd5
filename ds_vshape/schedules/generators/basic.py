"""GPipe and 1F1B on linear placement: the baselines everything else is measured against."""

from __future__ import annotations

from ..costs import Costs
from ..ir import BW, F, Action, Schedule
from ..placement import linear
from ..registry import register

__all__ = ["gpipe", "one_f_one_b"]


@register("gpipe", summary="all forwards, then all backwards; peak memory m")
def gpipe(p: int, m: int, *, v: int = 1, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    ranks = tuple(tuple([F(r, i) for i in range(m)] + [BW(r, i) for i in range(m)]) for r in range(p))
    return Schedule("gpipe", p, m, 1, 1, linear(p), ranks)


@register("1f1b", aliases=("one-f-one-b", "train"), summary="DeepSpeed's TrainSchedule order; peak memory p")
def one_f_one_b(p: int, m: int, *, v: int = 1, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    return Schedule("1f1b", p, m, 1, 1, linear(p), tuple(_one_f_one_b_rank(r, p, m) for r in range(p)))


def _one_f_one_b_rank(r: int, p: int, m: int) -> tuple[Action, ...]:
    warmup = min(p - r - 1, m)
    order: list[Action] = [F(r, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [F(r, warmup + i), BW(r, i)]
    order += [BW(r, i) for i in range(m - warmup, m)]
    return tuple(order)
