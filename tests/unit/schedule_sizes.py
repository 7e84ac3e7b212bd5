"""The (p, m) grid the transfer-order sweeps run every registered schedule over."""

from __future__ import annotations

from typing import Any

from ds_vshape.schedules import get_info

__all__ = ["sizes"]


def sizes(name: str, *, one_above_least: bool = False) -> list[tuple[int, int, dict[str, Any]]]:
    """``(p, m, generate kwargs)`` for p = 2..8: the fewest micro-batches the schedule takes and 2p
    (and one above the fewest, where the order's warm-up and drain meet differently)."""
    info = get_info(name)
    extra = {"seq_chunks": 2} if info.seq_chunks else {}
    out = []
    for p in range(2, 9):
        low = max(info.min_micro_batches(p, info.chunks(None), extra.get("seq_chunks", 1)), 1)
        ms = {low, 2 * p} | ({low + 1} if one_above_least else set())
        out += [(p, m, extra) for m in sorted(ms)]
    return out
