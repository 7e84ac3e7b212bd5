"""Placement: which rank owns which model stage. Kept apart from ordering on purpose:
the same order generator can be studied under another placement, and the runtime only
needs this table to build each rank's layers and to find each stage's peer."""

from __future__ import annotations

__all__ = ["linear", "looped", "vshape", "placement_name"]


def linear(p: int) -> tuple[int, ...]:
    """One stage per rank (v = 1): stage s on rank s."""
    _check_p(p)
    return tuple(range(p))


def looped(p: int, v: int) -> tuple[int, ...]:
    """Stage s on rank s mod p: each micro-batch loops through all ranks v times."""
    _check_p(p)
    if v < 1:
        raise ValueError(f"chunks per rank must be >= 1, got {v}")
    return tuple(s % p for s in range(p * v))


def vshape(p: int) -> tuple[int, ...]:
    """Rank r holds stages r and 2p-1-r: down the ranks, then back up.

    The first and the last stage share rank 0, so the loss and the embedding live
    together (tied weights need no all-reduce) and every rank holds the same memory.
    """
    _check_p(p)
    return tuple(range(p)) + tuple(reversed(range(p)))


def placement_name(stage_to_rank: tuple[int, ...], p: int) -> str:
    """'linear', 'looped', 'v' or 'custom' for a stage-to-rank table."""
    v = len(stage_to_rank) // p
    if stage_to_rank == linear(p):
        return "linear"
    if v == 2 and stage_to_rank == vshape(p):
        return "v"
    if stage_to_rank == looped(p, v):
        return "looped"
    return "custom"


def _check_p(p: int) -> None:
    if p < 1:
        raise ValueError(f"number of pipeline stages must be >= 1, got {p}")
