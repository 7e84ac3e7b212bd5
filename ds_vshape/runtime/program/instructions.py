"""DeepSpeed instructions for lowered ops, and the one ``PipeSchedule`` adapter.

The engine stays a DeepSpeed engine: it walks ``PipeSchedule.steps()`` and dispatches each
instruction through ``_INSTRUCTION_MAP``. Reduce and optimizer-step instructions are
DeepSpeed's own classes; the rest carry (stage, micro_batch, seq_chunk, peer, buffer_id).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from deepspeed.runtime.pipe import schedule as ds_schedule

from ...schedules import Schedule
from ...schedules.lowering import Op, OpKind, lower
from ...schedules.ops import split_units

__all__ = [
    "LoadMicroBatch", "PostRecvActivation", "RecvActivation", "ForwardPass", "SendActivation", "PostRecvGrad",
    "RecvGrad", "BackwardInput", "BackwardWeight", "FusedBackward", "SendGrad", "ReduceStageGrads", "GatherParams",
    "ReleaseParams", "IRSchedule",
    "to_instruction",
]


class _UnitInstruction(ds_schedule.PipeInstruction):
    """An instruction about one unit; kwargs: stage, micro_batch, seq_chunk, peer, buffer_id."""


class _CommInstruction(_UnitInstruction):
    """A send or receive; kwargs add ``header`` (this transfer carries the shapes)."""


class _PostInstruction(_CommInstruction):
    """Issue a receive (non-blocking); kwargs add ``with_next`` (one group with the next send)."""


class PostRecvActivation(_PostInstruction):
    pass


class PostRecvGrad(_PostInstruction):
    pass


class LoadMicroBatch(ds_schedule.PipeInstruction):
    pass


class RecvActivation(_CommInstruction):
    pass


class ForwardPass(_UnitInstruction):
    pass


class SendActivation(_CommInstruction):
    pass


class RecvGrad(_CommInstruction):
    pass


class BackwardInput(_UnitInstruction):
    """B: gradient w.r.t. the stage input; linear-layer weight GEMMs are parked."""


class BackwardWeight(_UnitInstruction):
    """W: the parked weight-gradient GEMMs of one unit."""


class FusedBackward(_UnitInstruction):
    """BW: the whole backward of one unit at once, as 1F1B runs it."""


class SendGrad(_CommInstruction):
    pass


class _StageInstruction(ds_schedule.PipeInstruction):
    def __init__(self, stage: int) -> None:
        super().__init__(stage=stage)


class ReduceStageGrads(_StageInstruction):
    """A stage's gradients are final for the step: its data-parallel reduce may start."""


class GatherParams(_StageInstruction):
    """A run of one stage's passes in one direction starts: its weights, whole (ZeRO-3)."""


class ReleaseParams(_StageInstruction):
    """That run ended: the stage's weights back to shards (ZeRO-3)."""


_CLASSES: dict[OpKind, type[ds_schedule.PipeInstruction]] = {
    OpKind.LOAD: LoadMicroBatch,
    OpKind.POST_ACT: PostRecvActivation,
    OpKind.POST_GRAD: PostRecvGrad,
    OpKind.RECV_ACT: RecvActivation,
    OpKind.FORWARD: ForwardPass,
    OpKind.SEND_ACT: SendActivation,
    OpKind.RECV_GRAD: RecvGrad,
    OpKind.BACKWARD_INPUT: BackwardInput,
    OpKind.BACKWARD_WEIGHT: BackwardWeight,
    OpKind.BACKWARD: FusedBackward,
    OpKind.SEND_GRAD: SendGrad,
    OpKind.REDUCE_STAGE_GRADS: ReduceStageGrads,
    OpKind.GATHER_PARAMS: GatherParams,
    OpKind.RELEASE_PARAMS: ReleaseParams,
    OpKind.REDUCE_TIED_GRADS: ds_schedule.ReduceTiedGrads,
    OpKind.REDUCE_GRADS: ds_schedule.ReduceGrads,
    OpKind.OPTIMIZER_STEP: ds_schedule.OptimizerStep,
}


def to_instruction(op: Op) -> ds_schedule.PipeInstruction:
    cls = _CLASSES[op.kind]
    if op.kind is OpKind.LOAD:
        return cls(micro_batch=op.micro_batch)
    unit = dict(stage=op.stage, micro_batch=op.micro_batch, seq_chunk=op.seq_chunk, peer=op.peer, buffer_id=op.buffer)
    if issubclass(cls, _PostInstruction):
        return cls(**unit, header=op.header, with_next=op.with_next)
    if issubclass(cls, _CommInstruction):
        return cls(**unit, header=op.header)
    if issubclass(cls, _UnitInstruction):
        return cls(**unit)
    if issubclass(cls, _StageInstruction):
        return cls(stage=op.stage)
    return cls()


class IRSchedule(ds_schedule.PipeSchedule):
    """Adapter: one rank's lowered ops as DeepSpeed's ``PipeSchedule`` (one op per step)."""

    def __init__(self, schedule: Schedule, rank: int, *, train: bool = True, without: frozenset[OpKind] = frozenset(),
                 global_order: bool = False, lowered: Sequence[Op] | None = None) -> None:
        """``without``: op kinds this engine would only dispatch as no-ops (each costs host time);
        ``global_order``: transfers in the step's one global order (``program.transfer_order``);
        ``lowered``: this rank's ops as lowered already (the plan's program), else lowered here."""
        super().__init__(micro_batches=schedule.micro_batches, stages=schedule.stages, stage_id=rank)
        self.schedule = schedule
        self.global_order = global_order
        ops = lowered if lowered is not None else lower(schedule, rank, train=train, one_queue=global_order)
        self.ops = [op for op in ops if op.kind not in without]
        self._instructions = [to_instruction(op) for op in self.ops]
        self.split_units = split_units(self.ops)  # the units whose forwards split backward routes

    def steps(self) -> Iterator[list[ds_schedule.PipeInstruction]]:
        for instruction in self._instructions:
            yield [instruction]

    def num_pipe_buffers(self) -> int:
        return 1 + max((op.buffer for op in self.ops if op.buffer is not None), default=0)
