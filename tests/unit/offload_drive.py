"""What the offload unit tests share: a one-rank schedule's passes driven as the engine drives
them (``before_pass`` before each compute pass), the small MLP and its seeded micro-batches."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ds_vshape.runtime.offload.offloader import Offloader
from ds_vshape.schedules import Kind, Schedule
from ds_vshape.schedules.lowering import lower
from ds_vshape.schedules.ops import Op, OpKind

__all__ = ["mlp", "micro_batches", "passes", "one_rank"]

_KIND = {OpKind.FORWARD: Kind.F, OpKind.BACKWARD_INPUT: Kind.B, OpKind.BACKWARD_WEIGHT: Kind.W, OpKind.BACKWARD: Kind.BW}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))


def micro_batches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g).requires_grad_() for _ in range(n)]


def one_rank(order: str, *, micro_batches: int = 3) -> tuple[Schedule, list[Op]]:
    """A schedule of one stage on one rank, from its text (``"0F0 0F1 0BW0 0BW1"``), and its lowered ops."""
    schedule = Schedule.from_text([order], name="t", micro_batches=micro_batches, stage_to_rank=[0])
    return schedule, lower(schedule, 0)


def passes(off: Offloader, ops: list[Op]) -> Iterator[tuple[Op, Kind, tuple[int, int, int], int]]:
    """The compute passes of ``ops`` as (op, kind, unit, micro-batch), each announced to ``off`` first."""
    for op in ops:
        kind = _KIND.get(op.kind)
        if kind is None:
            continue
        unit = (op.stage, op.micro_batch, op.seq_chunk)
        off.before_pass(kind, unit)
        yield op, kind, unit, op.micro_batch
