"""Seq1F1B (Sun et al., NAACL 2025): 1F1B over (micro-batch, sequence chunk) units.

The same order as ``1f1b`` with ``seq_chunks=k`` (see ``basic``), under its own name and
with k = 2 when none is given. Each micro-batch's sequence is cut into k chunks and 1F1B
runs on the k m units, so the pipeline fills and drains in 1/k of a micro-batch: bubble
(p-1)/(k m + p-1), and rank 0 keeps p-1+k units of 1/k each in flight: peak
(1 + (p-1)/k) M_B instead of p M_B. Linear placement, fused BW.
"""

from __future__ import annotations

from ..costs import Costs
from ..ir import Schedule
from ..placement import linear
from .builtin import builtin
from .basic import one_f_one_b_ranks

__all__ = ["seq1f1b"]


@builtin(
    "seq1f1b",
    summary="1F1B over sequence chunks (k per micro-batch, default 2); bubble (p-1)/(km+p-1), peak 1+(p-1)/k",
    seq_chunks=True,
    default_seq_chunks=2,
)
def seq1f1b(p: int, m: int, *, v: int = 1, k: int = 2, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    if k < 1:
        raise ValueError(f"seq1f1b needs seq_chunks >= 1, got {k}")
    return Schedule("seq1f1b", p, m, 1, k, linear(p), one_f_one_b_ranks(p, m, k=k))
