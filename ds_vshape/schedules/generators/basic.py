"""GPipe and 1F1B on linear placement: the baselines everything else is measured against.

1F1B takes sequence chunks (``seq_chunks=k``): it then runs on the m k (micro-batch, chunk)
units (see ``_seq_units``) with k-1 more warm-up forwards per rank, which is Seq1F1B
(Sun et al.): bubble (p-1)/(k m + p-1), peak (1 + (p-1)/k) M_B on rank 0.
"""

from __future__ import annotations

from ..costs import Costs
from ..ir import BW, F, Action, Schedule
from ..placement import linear
from .builtin import builtin
from ._seq_units import expand_units

__all__ = ["gpipe", "one_f_one_b", "one_f_one_b_ranks"]


@builtin("gpipe", summary="all forwards, then all backwards; peak memory m")
def gpipe(p: int, m: int, *, v: int = 1, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    ranks = tuple(tuple([F(r, i) for i in range(m)] + [BW(r, i) for i in range(m)]) for r in range(p))
    return Schedule("gpipe", p, m, 1, 1, linear(p), ranks)


@builtin(
    "1f1b",
    aliases=("one-f-one-b", "train"),
    summary="DeepSpeed's TrainSchedule order; peak memory p (1 + (p-1)/k with k seq chunks)",
    seq_chunks=True,
)
def one_f_one_b(p: int, m: int, *, v: int = 1, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    return Schedule("1f1b", p, m, 1, k, linear(p), one_f_one_b_ranks(p, m, k=k))


def one_f_one_b_ranks(p: int, m: int, *, k: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Every rank's 1F1B order over the m k units of k sequence chunks per micro-batch."""
    if k < 1:
        raise ValueError(f"1f1b needs seq_chunks >= 1, got {k}")
    return tuple(expand_units(_one_f_one_b_rank(r, p, m * k, extra_warmup=k - 1), k) for r in range(p))


def _one_f_one_b_rank(r: int, p: int, m: int, *, extra_warmup: int = 0) -> tuple[Action, ...]:
    # 1F1B's p-r-1 warm-up forwards, plus k-1 with sequence chunks: the last chunk of a
    # micro-batch must be forwarded on this rank before its first backward (that chunk's)
    # can come back.
    warmup = min(p - r - 1 + extra_warmup, m)
    order: list[Action] = [F(r, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [F(r, warmup + i), BW(r, i)]
    order += [BW(r, i) for i in range(m - warmup, m)]
    return tuple(order)
