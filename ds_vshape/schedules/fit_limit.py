"""How much of W's work a split-backward schedule can take into B before it falls behind 1F1B.

When the engine holds W to a ``w_memory`` below what a model's W really keeps, it computes
some weight gradients in B (``runtime/split/fit.py``): B grows by that work, W shrinks by it,
and the bubble that W's freedom filled comes back. ``moved_share_limit`` asks the simulator
how far that may go: the largest share ``s`` of W's work moved into B (B costing ``1 + s``,
W ``1 - s``, F 1, per slice of the model) at which the schedule still takes no longer than
DeepSpeed's 1F1B on the same ranks and micro-batches with fused backwards. Unit costs stand
in for the real ones, which the engine does not know here (a schedule ordered for measured or
given costs is judged on unit costs too: a conservative limit where its order suits its costs).
"""

from __future__ import annotations

from .costs import Costs
from .ir import Schedule
from .registry import generate
from .simulate import simulate

__all__ = ["moved_share_limit"]

_STEPS = 20  # shares tried: 0, 0.05, ..., 1


def moved_share_limit(schedule: Schedule) -> float:
    """The largest share of W's work, on a grid of 1/20, that B may take with ``schedule`` still no
    slower than 1F1B (0 when even none is: the fit then moves nothing)."""
    w_memory = float(schedule.params.get("w_memory", 0.0))
    baseline = simulate(generate("1f1b", schedule.stages, schedule.micro_batches), Costs(f=1, b=1, w=1)).makespan  # BW costs b + w
    best = 0.0
    for step in range(_STEPS + 1):
        share = step / _STEPS
        costs = Costs(f=1, b=1 + share, w=1 - share, w_memory=w_memory)
        if simulate(schedule, costs).makespan > baseline + 1e-9:
            break
        best = share
    return best
