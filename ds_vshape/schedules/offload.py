"""Which units' activations go to host memory, and when they come back (PipeOffload).

A unit's saved activations are idle from the end of its forward to the start of its
backward. Offloading them to host memory in that window frees device memory; the copies
hide behind the passes that run meanwhile when the window holds at least one other pass.
With the V placement a rank's first chunk lives longest (its backward comes last), so whole
stages are taken longest-lived first, which cuts the peak better than a linear share
(REFERENCE section 5).

``offload_units`` picks the units of a rank for an offload ``share`` (0..1 of the rank's
activation), ``reload_points`` says at which pass each unit's reload starts (the pass right
before its backward: the copy overlaps that pass), ``offload_plan`` bundles both.

Split backward: what B keeps for W (the weight GEMMs' inputs and output gradients) is idle
from B to W. With any share above 0, for every unit whose W runs apart from its B (another
pass in between), offloaded or not, it goes to host after B and comes back one pass ahead of
W (``w_reload_points``): under V placement the second chunk's kept tensors, outside a 0.5
share, are what would otherwise stay at the peak. The runtime executes the plan; the simulator counts it
(``simulate(..., offload=share)``).
Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .costs import Costs
from .ir import Action, Kind, Schedule, Unit

__all__ = ["OffloadPlan", "lifespans", "offload_units", "reload_points", "w_reload_points", "offload_plan",
           "check_share"]

_EPS = 1e-9


@dataclass(frozen=True)
class OffloadPlan:
    """One rank's offload: the units, the pass index at which each one's reload starts, the share
    taken; ``w_reload_at``: the same for what B keeps for W (``w_reload_points``)."""

    units: frozenset[Unit]
    reload_at: dict[int, tuple[Unit, ...]]
    share: float
    w_reload_at: dict[int, tuple[Unit, ...]] = field(default_factory=dict)

    @property
    def w_units(self) -> frozenset[Unit]:
        """The units whose W-kept tensors go to host after B."""
        return frozenset(u for us in self.w_reload_at.values() for u in us)


def check_share(share: float) -> float:
    """The share itself, or ``ValueError`` when it is not in [0, 1]."""
    if not 0.0 <= share <= 1.0:  # also refuses NaN
        raise ValueError(f"pipeline.offload is the share of a rank's activation to offload and must be in [0, 1], got {share}")
    return share


def lifespans(actions: Sequence[Action]) -> dict[Unit, int]:
    """Per unit of a rank's pass order: passes from its forward to its first backward (B or BW).

    1 means the backward runs right after the forward: nothing to hide a copy behind.
    """
    start: dict[Unit, int] = {}
    out: dict[Unit, int] = {}
    for pos, a in enumerate(actions):
        if a.kind is Kind.F:
            start[a.unit] = pos
        elif a.kind.is_backward and a.unit in start and a.unit not in out:
            out[a.unit] = pos - start[a.unit]
    return out


def offload_units(schedule: Schedule, rank: int, share: float, *, costs: Costs | None = None) -> frozenset[Unit]:
    """The units of ``rank`` whose activations go to host: up to ``share`` of its activation.

    Whole stages first, the longest-lived stage (mean lifespan of its units) first; within a
    stage the longest-lived units first, then by micro-batch and chunk. A unit weighs its
    sequence chunk's share (``costs.seq_weights``), so the taken weight never exceeds
    ``share``. Units whose backward follows their forward directly are never taken.
    """
    check_share(share)
    costs = costs or Costs()
    k = schedule.seq_chunks
    spans = lifespans(schedule.ranks[rank])
    weight = {u: costs.seq_share(u[2], k) for u in spans}
    total = sum(weight.values())
    if share <= 0 or total <= 0:
        return frozenset()
    by_stage: dict[int, list[Unit]] = {}
    for u in spans:
        by_stage.setdefault(u[0], []).append(u)
    mean = {s: sum(spans[u] for u in us) / len(us) for s, us in by_stage.items()}
    order = [u for s in sorted(by_stage, key=lambda s: (-mean[s], s))
             for u in sorted(by_stage[s], key=lambda u: (-spans[u], u[1], u[2]))]
    taken: list[Unit] = []
    budget, used = share * total, 0.0
    for u in order:
        if spans[u] < 2:
            continue
        if used + weight[u] <= budget + _EPS:
            taken.append(u)
            used += weight[u]
    return frozenset(taken)


def reload_points(passes: Sequence[Action], units: frozenset[Unit], *, lead: int = 1) -> dict[int, tuple[Unit, ...]]:
    """Pass index -> units whose reload starts as that pass starts: ``lead`` passes before the
    unit's first backward, never before the pass after its forward. ``passes`` is the order the
    rank runs (fused BW where lowering fused them)."""
    if lead < 1:
        raise ValueError(f"lead must be >= 1 pass, got {lead}")
    forward_at: dict[Unit, int] = {}
    points: dict[int, list[Unit]] = {}
    seen: set[Unit] = set()
    for pos, a in enumerate(passes):
        if a.kind is Kind.F:
            forward_at[a.unit] = pos
        elif a.kind.is_backward and a.unit in units and a.unit not in seen:
            seen.add(a.unit)
            if a.unit not in forward_at:
                raise ValueError(f"unit {a.unit} runs backward at pass {pos} before its forward")
            at = max(pos - lead, forward_at[a.unit] + 1)
            points.setdefault(at, []).append(a.unit)
    missing = units - seen
    if missing:
        raise ValueError(f"offloaded units {sorted(missing)[:3]} have no backward in this pass order")
    return {pos: tuple(us) for pos, us in sorted(points.items())}


def w_reload_points(passes: Sequence[Action], units: frozenset[Unit], *, lead: int = 1) -> dict[int, tuple[Unit, ...]]:
    """Pass index -> units whose W-kept tensors' reload starts as that pass starts.

    Only units of ``units`` with a W of their own at least two passes after their B (one pass
    or more in between to hide the copies behind): ``lead`` passes before the W, never before
    the pass right after the B. Fused backward (BW) keeps nothing for a W; a W right after its
    B is left on the device.
    """
    if lead < 1:
        raise ValueError(f"lead must be >= 1 pass, got {lead}")
    b_at: dict[Unit, int] = {}
    points: dict[int, list[Unit]] = {}
    for pos, a in enumerate(passes):
        if a.unit not in units:
            continue
        if a.kind is Kind.B:
            b_at[a.unit] = pos
        elif a.kind is Kind.W and a.unit in b_at and pos - b_at[a.unit] >= 2:
            points.setdefault(max(pos - lead, b_at[a.unit] + 1), []).append(a.unit)
    return {pos: tuple(us) for pos, us in sorted(points.items())}


def offload_plan(schedule: Schedule, rank: int, share: float, *, costs: Costs | None = None,
                 passes: Sequence[Action] | None = None) -> OffloadPlan:
    """``offload_units`` and their ``reload_points`` in ``passes`` (default: the schedule's own order)."""
    units = offload_units(schedule, rank, share, costs=costs)
    order = schedule.ranks[rank] if passes is None else passes
    costs = costs or Costs()
    k = schedule.seq_chunks
    every = [a.unit for a in schedule.ranks[rank] if a.kind is Kind.F]
    total = sum(costs.seq_share(u[2], k) for u in every)
    taken = sum(costs.seq_share(u[2], k) for u in units) / total if total else 0.0
    # What B keeps for W goes for every unit of the rank, not only the share's: it is idle from B to W
    # whatever the unit, and outside the share it is what stays on the device at V's peak.
    return OffloadPlan(units, reload_points(order, units), taken, w_reload_points(order, frozenset(every)))
