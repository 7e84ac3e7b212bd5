"""The plan: everything the engine runs by, made once at the front door (``ds_vshape.initialize``).

A ``Plan`` holds the schedule, how to make the same schedule for another number of
micro-batches, what the engine takes of the ``"pipeline"`` config (``EngineSettings``), auto's
settings, and every rank's lowered program, whose transfers are checked under NCCL's rules
when the plan is made. The engine never reads the config: it gets a plan, and a schedule
change (DeepSpeed's batch ramp-up, auto's choice) is a new plan the engine swaps in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from ...schedules import Schedule
from ...schedules.auto import AutoSettings
from ...schedules.lowering import programs
from ...schedules.ops import Op
from ...schedules.p2p_check import check_transfers

__all__ = ["EngineSettings", "Plan"]


@dataclass(frozen=True)
class EngineSettings:
    """What the engine takes of the ``"pipeline"`` config, resolved by ``ds_vshape.initialize``."""

    p2p_timeout_s: float  # a transfer or step collective waiting longer fails the step, naming the peer
    measure_memory: bool = False  # saved-tensor hooks count activation bytes on every step
    post_validation: bool = False  # step on local information, check the global norm later (step_end/post_validation)
    speculate_after: int | None = None  # steps that stood before the next step starts ahead of the check
    offload: float = 0.0  # share of each rank's activation sent to host memory (runtime/offload)
    seq_partition: Literal["equal", "compute"] = "equal"  # where sequence chunks are cut (program/seq_chunks)
    seq_dims: dict[str, int] | None = None  # "compute": the model's dimensions the cut is computed from
    weight_grads_in_b: tuple[str, ...] = ()  # module-path patterns whose weight gradients B computes


@dataclass(frozen=True)
class Plan:
    """One schedule with all the engine needs to run it; ``programs`` are every rank's lowered ops,
    checked once here (a wrong transfer order fails at initialize, naming ranks, not as a hang)."""

    schedule: Schedule
    remake: Callable[[int], Schedule] = field(compare=False)  # the same schedule for m micro-batches
    settings: EngineSettings
    auto: AutoSettings | None = None  # set for ``"schedule": "auto"`` or pass_costs "measure" (the engine measures, then chooses)
    programs: tuple[tuple[Op, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Lowered as ``IRSchedule`` lowers a rank's training step by default (lookahead, per-pair
        # order): the engine runs its rank's program from here unless it needs the one global order.
        lowered = tuple(tuple(ops) for ops in programs(self.schedule))
        check_transfers(lowered)  # raises TransferOrderError (a ValueError) naming the ranks and ops
        object.__setattr__(self, "programs", lowered)

    def for_micro_batches(self, micro_batches: int) -> Plan:
        """This plan's schedule made for another number of micro-batches (DeepSpeed's batch ramp-up)."""
        return replace(self, schedule=self.remake(micro_batches))

    def switched(self, remake: Callable[[int], Schedule], *, micro_batches: int) -> Plan:
        """Another schedule (auto's choice) for ``micro_batches``; a later ramp-up remakes that one."""
        return replace(self, schedule=remake(micro_batches), remake=remake)
