"""Sequence chunks as scheduling units: the mapping every chunked generator shares.

With k sequence chunks per micro-batch a generator schedules ``m * k`` *units* as if they
were micro-batches, then names each pass after the (micro-batch, chunk) it computes:

* forward unit ``u`` is chunk ``u % k`` of micro-batch ``u // k``, so a micro-batch's chunks
  go forward 0..k-1 (a chunk's attention reads the keys and values of the earlier ones);
* backward unit ``u`` (B, W or BW) is chunk ``k - 1 - u % k`` of micro-batch ``u // k``, so
  they go backward k-1..0 (a later chunk's backward adds into the earlier chunks' key/value
  gradients, which must be complete before those chunks run their own backward).

Forward unit u and backward unit u are therefore different chunks: the backward of unit
``u`` can only start once forward unit ``(u // k) * k + k - 1`` (the micro-batch's last
chunk) is done, up to ``k - 1`` units later than in the unchunked order. Generators make
room for that wait: the linear ones run ``k - 1`` more warm-up forwards, the V ones shift
their backward passes ``k - 1`` periods later.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..ir import Action, Kind

__all__ = ["unit_action", "expand_units", "last_forward_unit"]


def unit_action(kind: Kind, stage: int, unit: int, k: int) -> Action:
    """The action of ``kind`` on ``stage`` for scheduling unit ``unit`` (module doc)."""
    micro_batch, offset = divmod(unit, k)
    chunk = offset if kind is Kind.F else k - 1 - offset
    return Action(kind, stage, micro_batch, chunk)


def expand_units(actions: Iterable[Action], k: int) -> tuple[Action, ...]:
    """Rename an order written over units (``micro_batch`` holds the unit) to real passes."""
    if k < 1:
        raise ValueError(f"seq_chunks must be >= 1, got {k}")
    return tuple(unit_action(a.kind, a.stage, a.micro_batch, k) for a in actions)


def last_forward_unit(backward_unit: int, k: int) -> int:
    """The forward unit the backward unit ``backward_unit`` waits for on the last stage."""
    return (backward_unit // k) * k + k - 1
