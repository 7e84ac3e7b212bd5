"""Validation: every unit computed exactly once, on its owner, in an order that can finish.

Rules, checked in this order: ``range``, ``ownership``, ``exactly-once``, ``backward-form``,
``seq-chunk-order`` (on each stage a micro-batch's sequence chunks go forward 0..k-1 and
backward, B or BW, k-1..0) and ``dependency`` (no deadlock).

A failure raises ScheduleError naming the rank, the position and the rule, with the
schedule grid attached, so a wrong generator is debugged from the message alone.
"""

from __future__ import annotations

from collections import Counter

from .ir import Action, Kind, Schedule

__all__ = ["ScheduleError", "validate", "prerequisites", "GRAD", "FWD"]

# A prerequisite is an event on a unit: its forward done, or its input gradient ready
# (made by either B or BW). W is never a prerequisite of another stage.
FWD = Kind.F
GRAD = Kind.B
Event = tuple[Kind, int, int, int]


class ScheduleError(ValueError):
    """A schedule breaks a rule; carries rank, position and the rule's name."""

    def __init__(self, schedule: Schedule, rule: str, message: str, *, rank: int | None = None, pos: int | None = None):
        self.rule, self.rank, self.pos = rule, rank, pos
        # A rule about a whole unit (backward-form) names the rank but no single step.
        where = "" if rank is None else f"rank {rank}: " if pos is None else f"rank {rank}, step {pos}: "
        mark = (rank, pos) if rank is not None and pos is not None else None
        super().__init__(f"{schedule.name}: {where}[{rule}] {message}\n{schedule.grid(mark=mark)}")


def prerequisites(action: Action, *, num_model_stages: int, seq_chunks: int) -> list[Event]:
    """Events that must have happened before ``action`` may start."""
    s, i, j = action.unit
    if action.kind is Kind.F:
        deps = [(FWD, s - 1, i, j)] if s > 0 else []
        return deps + ([(FWD, s, i, j - 1)] if j > 0 else [])
    if action.kind is Kind.W:
        return [(GRAD, s, i, j)]
    deps = [(FWD, s, i, j)]
    if s < num_model_stages - 1:
        deps.append((GRAD, s + 1, i, j))
    if j < seq_chunks - 1:
        # a later chunk's attention read this chunk's keys/values: its backward adds into them first
        deps.append((GRAD, s, i, j + 1))
    return deps


def event_of(action: Action) -> Event | None:
    """The event an action completes (W completes none that others wait on)."""
    if action.kind is Kind.F:
        return (FWD, *action.unit)
    if action.kind.is_backward:
        return (GRAD, *action.unit)
    return None


def validate(schedule: Schedule) -> Schedule:
    """Check ownership, coverage and that the per-rank orders can all complete; returns it."""
    _check_ownership(schedule)
    _check_coverage(schedule)
    _check_seq_chunk_order(schedule)
    _check_progress(schedule)
    return schedule


def _check_ownership(schedule: Schedule) -> None:
    S, m, k = schedule.num_model_stages, schedule.micro_batches, schedule.seq_chunks
    for rank, pos, a in schedule.actions():
        if not (0 <= a.stage < S and 0 <= a.micro_batch < m and 0 <= a.seq_chunk < k):
            raise ScheduleError(schedule, "range", f"{a} is outside stages 0..{S-1}, micro-batches 0..{m-1}, seq chunks 0..{k-1}", rank=rank, pos=pos)
        if schedule.stage_to_rank[a.stage] != rank:
            raise ScheduleError(schedule, "ownership", f"{a} runs on rank {rank} but stage {a.stage} lives on rank {schedule.stage_to_rank[a.stage]}", rank=rank, pos=pos)


def _check_coverage(schedule: Schedule) -> None:
    counts = Counter((a.kind, a.unit) for _, _, a in schedule.actions())
    first = {(a.kind, a.unit): (r, p) for r, p, a in reversed(list(schedule.actions()))}
    for (kind, unit), n in counts.items():
        if n > 1:
            r, p = first[(kind, unit)]
            raise ScheduleError(schedule, "exactly-once", f"{kind}{unit} appears {n} times", rank=r, pos=p)
    for s in range(schedule.num_model_stages):
        for i in range(schedule.micro_batches):
            for j in range(schedule.seq_chunks):
                _check_unit(schedule, counts, first, (s, i, j))


def _check_unit(schedule: Schedule, counts: Counter, first: dict, unit: tuple[int, int, int]) -> None:
    text = Action(Kind.F, *unit)
    owner = schedule.stage_to_rank[unit[0]]
    if counts[(Kind.F, unit)] != 1:
        raise ScheduleError(schedule, "exactly-once", f"no forward {text} (stage, micro-batch, chunk {unit})", rank=owner)
    has_bw, has_b, has_w = (counts[(k, unit)] for k in (Kind.BW, Kind.B, Kind.W))
    if has_bw and (has_b or has_w):
        r, p = first[(Kind.BW, unit)]
        raise ScheduleError(schedule, "backward-form", f"unit {unit} has a fused BW and also a split B/W", rank=r, pos=p)
    if not has_bw and not (has_b and has_w):
        missing = "B" if not has_b else "W"
        raise ScheduleError(schedule, "backward-form", f"unit {unit} has neither BW nor both B and W (missing {missing})", rank=owner)


def _check_seq_chunk_order(schedule: Schedule) -> None:
    """On every stage, a micro-batch's chunks run F in ascending and B/BW in descending order.

    A chunk's attention reads the keys and values of the earlier chunks, and a later chunk's
    backward adds into their gradients: an order breaking this can never run, and naming it
    here beats the generic deadlock that ``_check_progress`` would report.
    """
    if schedule.seq_chunks == 1:
        return
    for rank, actions in enumerate(schedule.ranks):
        seen: dict[tuple[bool, int, int], tuple[int, int]] = {}  # (backward?, stage, mb) -> (chunk, step)
        for pos, a in enumerate(actions):
            if a.kind is Kind.W:
                continue
            backward = a.kind.is_backward
            key = (backward, a.stage, a.micro_batch)
            if key in seen:
                chunk, step = seen[key]
                if (a.seq_chunk > chunk) if backward else (a.seq_chunk < chunk):
                    _raise_chunk_order(schedule, rank, pos, a, chunk, step)
            seen[key] = (a.seq_chunk, pos)


def _raise_chunk_order(schedule: Schedule, rank: int, pos: int, a: Action, chunk: int, step: int) -> None:
    kind = "backward" if a.kind.is_backward else "forward"
    rule = "descending, k-1..0" if a.kind.is_backward else "ascending, 0..k-1"
    message = (
        f"{a} runs the {kind} of seq chunk {a.seq_chunk} of micro-batch {a.micro_batch} on stage {a.stage} after that of "
        f"chunk {chunk} (step {step}); a micro-batch's chunks run {kind} in {rule} order on every stage: "
        f"move {a} before step {step}"
    )
    raise ScheduleError(schedule, "seq-chunk-order", message, rank=rank, pos=pos)


def _check_progress(schedule: Schedule) -> None:
    """Run the orders with unit time; a round with no progress is a deadlock."""
    S, k = schedule.num_model_stages, schedule.seq_chunks
    done: set[Event] = set()
    heads = [0] * schedule.stages
    remaining = sum(len(a) for a in schedule.ranks)
    while remaining:
        finished = []
        for rank, actions in enumerate(schedule.ranks):
            if heads[rank] < len(actions):
                a = actions[heads[rank]]
                if all(d in done for d in prerequisites(a, num_model_stages=S, seq_chunks=k)):
                    finished.append(a)
                    heads[rank] += 1
        if not finished:
            _raise_deadlock(schedule, heads, done)
        for a in finished:
            ev = event_of(a)
            if ev is not None:
                done.add(ev)
        remaining -= len(finished)


def _raise_deadlock(schedule: Schedule, heads: list[int], done: set[Event]) -> None:
    S, k = schedule.num_model_stages, schedule.seq_chunks
    for rank, actions in enumerate(schedule.ranks):
        if heads[rank] < len(actions):
            a = actions[heads[rank]]
            missing = [d for d in prerequisites(a, num_model_stages=S, seq_chunks=k) if d not in done]
            need = ", ".join(f"{'F' if kind is FWD else 'B/BW'} of stage {s} mb {i} chunk {j}" for kind, s, i, j in missing)
            raise ScheduleError(schedule, "dependency", f"{a} waits for {need}, which can never come first (deadlock)", rank=rank, pos=heads[rank])
