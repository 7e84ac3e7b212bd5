"""Lowered operations: what one rank executes, one instruction each.

Pure data shared by the lowering passes, the transfer-order passes and the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["OpKind", "Op", "SENDS", "POSTS", "WAITS", "COMPUTE", "BACKWARDS", "DATA_PARALLEL", "format_ops", "split_units"]


class OpKind(str, Enum):
    LOAD = "load"
    POST_ACT = "post_act"  # issue the receive of activations (non-blocking)
    RECV_ACT = "recv_act"  # wait for a posted receive of activations, right before its forward
    FORWARD = "forward"
    SEND_ACT = "send_act"
    POST_GRAD = "post_grad"
    RECV_GRAD = "recv_grad"
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    REDUCE_STAGE_GRADS = "reduce_stage_grads"  # a stage's backward is done: its data-parallel reduce may start
    GATHER_PARAMS = "gather_params"  # a run of one stage's passes in one direction starts: its sharded weights, whole
    RELEASE_PARAMS = "release_params"  # that run ended: back to shards
    REDUCE_TIED_GRADS = "reduce_tied_grads"
    REDUCE_GRADS = "reduce_grads"
    OPTIMIZER_STEP = "optimizer_step"


SENDS = frozenset({OpKind.SEND_ACT, OpKind.SEND_GRAD})
POSTS = frozenset({OpKind.POST_ACT, OpKind.POST_GRAD})
WAITS = frozenset({OpKind.RECV_ACT, OpKind.RECV_GRAD})
COMPUTE = frozenset({OpKind.FORWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT, OpKind.BACKWARD})
BACKWARDS = COMPUTE - {OpKind.FORWARD}
# Points for ZeRO's data-parallel work; an engine whose ZeRO stage needs none drops them.
DATA_PARALLEL = frozenset({OpKind.REDUCE_STAGE_GRADS, OpKind.GATHER_PARAMS, OpKind.RELEASE_PARAMS})
_ACT_KINDS = frozenset({OpKind.SEND_ACT, OpKind.POST_ACT, OpKind.RECV_ACT})  # what moves activations (``Op.transfer``)


@dataclass(frozen=True, slots=True)
class Op:
    """One instruction for one rank.

    ``stage`` is the model stage the data belongs to (for transfers: the stage that consumes
    it); ``peer`` the other pipeline rank. ``header``: this transfer also carries the tensors'
    shapes. ``with_next``: a posted receive issued together with the send that follows it,
    in one group (both start at once, so two ranks sending to each other cannot wait on
    each other's receive).
    """

    kind: OpKind
    stage: int = -1
    micro_batch: int = -1
    seq_chunk: int = 0
    peer: int | None = None
    buffer: int | None = None
    header: bool = False
    with_next: bool = False

    @property
    def transfer(self) -> tuple[str, int, int, int]:
        """What a send, post or wait moves: (direction, consuming stage, micro-batch, chunk).
        Both ends of one transfer name it the same way."""
        direction = "act" if self.kind in _ACT_KINDS else "grad"
        return (direction, self.stage, self.micro_batch, self.seq_chunk)

    def __str__(self) -> str:
        parts = [self.kind.value]
        if self.stage >= 0:
            parts.append(f"s{self.stage}")
        if self.micro_batch >= 0:
            parts.append(f"mb{self.micro_batch}" + (f".{self.seq_chunk}" if self.seq_chunk else ""))
        if self.peer is not None:
            parts.append(f"peer{self.peer}")
        if self.buffer is not None:
            parts.append(f"buf{self.buffer}")
        if self.header:
            parts.append("hdr")
        if self.with_next:
            parts.append("+next")
        return " ".join(parts)


def format_ops(ops: list[Op]) -> str:
    return "\n".join(f"{pos:4d}  {op}" for pos, op in enumerate(ops))


def split_units(ops: list[Op]) -> frozenset[tuple[int, int, int]]:
    """The (stage, micro_batch, seq_chunk) units whose backward these ops split into B and W.

    Only their forwards need split backward's routing: a unit whose backward runs fused (the
    first stage's, which sends no input gradient, or a B the lowering merged with its W) is
    plain autograd from forward to backward, and routing it would only cost time.
    """
    return frozenset((op.stage, op.micro_batch, op.seq_chunk) for op in ops if op.kind is OpKind.BACKWARD_INPUT)
