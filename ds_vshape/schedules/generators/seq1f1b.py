"""Seq1F1B (Sun et al., NAACL 2025): 1F1B over (micro-batch, sequence chunk) units.

Each micro-batch's sequence is cut into k chunks and 1F1B runs on the k m units, so the
pipeline fills and drains in 1/k of a micro-batch: bubble (p-1)/(k m + p-1), and rank 0
keeps p-1+k units of 1/k each in flight: peak (1 + (p-1)/k) M_B instead of p M_B.
Linear placement, fused BW.
"""

from __future__ import annotations

from ..costs import Costs
from ..ir import BW, F, Action, Schedule
from ..placement import linear
from ..registry import register

__all__ = ["seq1f1b"]


@register(
    "seq1f1b",
    summary="1F1B over sequence chunks (k per micro-batch); bubble (p-1)/(km+p-1), peak 1+(p-1)/k",
    seq_chunks=True,
)
def seq1f1b(p: int, m: int, *, v: int = 1, k: int = 2, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    if k < 1:
        raise ValueError(f"seq1f1b needs seq_chunks >= 1, got {k}")
    ranks = tuple(_seq1f1b_rank(r, p, m, k) for r in range(p))
    return Schedule("seq1f1b", p, m, 1, k, linear(p), ranks)


def _seq1f1b_rank(r: int, p: int, m: int, k: int) -> tuple[Action, ...]:
    # Forward runs a micro-batch's chunks 0..k-1 (a chunk's attention reads the keys and
    # values of the earlier ones); backward runs them k-1..0 because a later chunk's backward
    # adds into the key/value gradients of the earlier chunks, which must be complete first.
    fwd = [F(r, i, j) for i in range(m) for j in range(k)]
    bwd = [BW(r, i, j) for i in range(m) for j in reversed(range(k))]
    # 1F1B's p-r-1 plus k-1: the last chunk of micro-batch 0 must be forwarded on this rank
    # before its first backward (chunk k-1 of micro-batch 0) can come back.
    warmup = min(p - r - 1 + (k - 1), len(fwd))
    order: list[Action] = fwd[:warmup]
    for step in range(len(fwd) - warmup):
        order += [fwd[warmup + step], bwd[step]]
    order += bwd[len(fwd) - warmup :]
    return tuple(order)
