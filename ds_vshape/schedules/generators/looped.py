"""Looped placement (stage s on rank s mod p): depth-first and breadth-first orders, fused BW.

Each rank holds v chunks, so a micro-batch loops through the ranks v times and the warm-up
and drain of the pipeline shrink to 1/v of a 1F1B stage: bubble (p-1)/(v m + p-1).

* ``interleaved``: depth-first, Megatron-LM's interleaved 1F1B order. Micro-batches go in
  groups of p (p to 2p-1 when p does not divide m) through every local chunk before the
  next group, then 1F1B steady state.
* ``breadth-first``: every micro-batch through one local chunk before the next chunk, the
  backward in reverse chunk order (Lamy-Poirier 2022). Each chunk's weights are needed in
  one stretch per step and its gradients are complete in one burst, which is why it pairs
  with ZeRO-2/3 (one gather and one reduce-scatter per chunk and step); activation memory
  is GPipe-like (m M_B).
"""

from __future__ import annotations

from ..costs import Costs
from ..ir import BW, F, Action, Schedule
from ..placement import looped
from .builtin import builtin

__all__ = ["interleaved", "breadth_first"]


@builtin(
    "interleaved",
    aliases=("interleaved-1f1b", "depth-first"),
    summary="Megatron interleaved 1F1B (depth-first) on looped placement; v chunks per rank",
    fixed_chunks=None,
    placement="looped",
    min_micro_batches=lambda p, v, k: p,
)
def interleaved(p: int, m: int, *, v: int = 2, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    if m < p:
        # With fewer than p micro-batches rank 0 runs out of work before micro-batch 0 comes
        # round for its next chunk: every loop adds idle time, the bound no longer holds, and
        # Megatron-LM (whose order this is) traditionally asks for a multiple of p.
        raise ValueError(f"interleaved needs at least p = {p} micro-batches (any m >= p, not only multiples of p), got {m}")
    table = _depth_first_table(p, m, v)
    ranks = tuple(_interleaved_rank(r, p, m, v, table) for r in range(p))
    return Schedule("interleaved", p, m, v, 1, looped(p, v), ranks, params={"groups": _group_sizes(p, m)})


def _group_sizes(p: int, m: int) -> list[int]:
    """Micro-batches per group: m // p groups as even as possible, each of p to 2p-1.

    Megatron-LM uses groups of exactly p and so wants m a multiple of p. A group of at least
    p keeps every rank busy until the group's first micro-batch comes round for the next
    chunk; spreading the remainder over the groups makes any m >= p work with the same
    bubble bound (a short last group instead deadlocks this warm-up and steady state).
    """
    n = m // p
    return [m // n + (1 if g < m % n else 0) for g in range(n)]


def _depth_first_table(p: int, m: int, v: int) -> list[tuple[int, int]]:
    """Forward order of (micro_batch, local_chunk), shared by every rank: each group of
    micro-batches goes through chunk 0, 1, ..., v-1 before the next group starts."""
    table: list[tuple[int, int]] = []
    low = 0
    for size in _group_sizes(p, m):
        table += [(i, c) for c in range(v) for i in range(low, low + size)]
        low += size
    return table


def _interleaved_rank(r: int, p: int, m: int, v: int, table: list[tuple[int, int]]) -> tuple[Action, ...]:
    total = m * v
    # Megatron's warm-up: enough forwards to fill v-1 loops of the first group, plus 2 per
    # rank still downstream (the forward going down, the gradient coming back). With v = 1
    # Megatron runs plain 1F1B, whose warm-up is p-r-1.
    downstream = (p - r - 1) * (2 if v > 1 else 1)
    warmup = min(total, downstream + (v - 1) * _group_sizes(p, m)[0])
    fwd = [F(c * p + r, i) for i, c in table]
    bwd = [BW((v - 1 - c) * p + r, i) for i, c in table]
    order: list[Action] = fwd[:warmup]
    for step in range(total - warmup):
        order += [fwd[warmup + step], bwd[step]]
    order += bwd[total - warmup :]
    return tuple(order)


@builtin(
    "breadth-first",
    aliases=("looped-bfs", "bfs"),
    summary="breadth-first on looped placement: all micro-batches per chunk, so ZeRO-2/3 reduce each chunk once; memory m",
    fixed_chunks=None,
    placement="looped",
)
def breadth_first(p: int, m: int, *, v: int = 2, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    # Valid for any m; with m < p rank 0 waits at every loop for the first micro-batch to
    # come round, so the bubble bound (p-1)/(v m + p-1) holds from m = p on.
    ranks = tuple(_breadth_first_rank(r, p, m, v) for r in range(p))
    return Schedule("breadth-first", p, m, v, 1, looped(p, v), ranks)


def _breadth_first_rank(r: int, p: int, m: int, v: int) -> tuple[Action, ...]:
    # Backward keeps micro-batches in forward order: the last stage finishes micro-batch 0
    # first, so its gradient is the first to start back up the pipe.
    fwd = [F(c * p + r, i) for c in range(v) for i in range(m)]
    bwd = [BW(c * p + r, i) for c in reversed(range(v)) for i in range(m)]
    return tuple(fwd + bwd)
