"""The lowered stream's data-parallel points on a simulated timeline, as Chrome trace events.

``reduce_stage_grads``, ``gather_params`` and ``release_params`` take no time in the simulator;
each is drawn as an instant event on its rank, at the start of the pass it precedes or the end
of the pass it follows, so a trace shows where ZeRO's reduce-scatters start and where a stage's
weights are gathered and released.
"""

from __future__ import annotations

from typing import Any

from .ir import Kind, Schedule, Unit
from .lowering import lower
from .ops import COMPUTE, DATA_PARALLEL, Op, OpKind
from .simulate import SimResult

__all__ = ["data_parallel_events"]

_BEFORE = frozenset({OpKind.GATHER_PARAMS})  # placed before the next pass; the others after the previous one


def _spans(timeline: tuple[tuple[float, float, Any], ...]) -> dict[tuple[str, Unit], tuple[float, float]]:
    """(pass letter, unit) -> (start, end); a fused BW also answers for the unit's B and W."""
    spans: dict[tuple[str, Unit], tuple[float, float]] = {}
    for start, end, action in timeline:
        unit = (action.stage, action.micro_batch, action.seq_chunk)
        spans[(action.kind.value, unit)] = (start, end)
    return spans


def _span_of(op: Op, spans: dict[tuple[str, Unit], tuple[float, float]]) -> tuple[float, float] | None:
    unit = (op.stage, op.micro_batch, op.seq_chunk)
    if op.kind is OpKind.FORWARD:
        return spans.get((Kind.F.value, unit))
    if op.kind is OpKind.BACKWARD_INPUT:
        return spans.get((Kind.B.value, unit))
    if op.kind is OpKind.BACKWARD_WEIGHT:
        return spans.get((Kind.W.value, unit))
    # A fused backward: the schedule's BW, or the B and W lowering merged.
    if (Kind.BW.value, unit) in spans:
        return spans[(Kind.BW.value, unit)]
    b, w = spans.get((Kind.B.value, unit)), spans.get((Kind.W.value, unit))
    return (b[0], w[1]) if b and w else None


def _times(ops: list[Op], spans: dict[tuple[str, Unit], tuple[float, float]]) -> list[tuple[float, Op]]:
    out: list[tuple[float, Op]] = []
    for i, op in enumerate(ops):
        if op.kind not in DATA_PARALLEL:
            continue
        step = 1 if op.kind in _BEFORE else -1
        j = i + step
        while 0 <= j < len(ops) and ops[j].kind not in COMPUTE:
            j += step
        span = _span_of(ops[j], spans) if 0 <= j < len(ops) else None
        if span is not None:
            out.append((span[0] if op.kind in _BEFORE else span[1], op))
    return out


def data_parallel_events(result: SimResult, schedule: Schedule, *, time_unit_us: float = 1000.0) -> list[dict[str, Any]]:
    """Instant events (one per data-parallel op of every rank's lowered training stream)."""
    events = []
    for rank, timeline in enumerate(result.timeline):
        for t, op in _times(lower(schedule, rank), _spans(timeline)):
            events.append({"name": f"{op.kind.value} s{op.stage}", "cat": "data-parallel", "ph": "i", "s": "t",
                           "pid": 0, "tid": rank, "ts": t * time_unit_us, "args": {"op": op.kind.value, "stage": op.stage}})
    return events
