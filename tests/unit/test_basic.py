"""Our ``1f1b`` runs the compute passes in the order DeepSpeed's TrainSchedule runs them."""

from __future__ import annotations

import pytest

from ds_vshape.schedules import generate

pipe_schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")


def _deepspeed_order(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """(kind, micro_batch) of every ForwardPass/BackwardPass TrainSchedule yields for a stage.

    The instructions carry only a buffer id (micro_batch % num_pipe_buffers), so the
    micro-batch is read from the schedule's own step mapping; the buffer id is checked
    against it so that the mapping cannot drift from what the engine executes.
    """
    sched = pipe_schedule.TrainSchedule(micro_batches=m, stages=p, stage_id=stage)
    order = []
    for step_id, cmds in enumerate(sched.steps()):
        for cmd in cmds:
            if isinstance(cmd, (pipe_schedule.ForwardPass, pipe_schedule.BackwardPass)):
                micro_batch, is_forward = sched._step_to_micro_batch(step_id)
                assert is_forward == isinstance(cmd, pipe_schedule.ForwardPass)
                assert cmd.buffer_id == sched._buffer_idx(micro_batch)
                order.append(("F" if is_forward else "BW", micro_batch))
    return order


@pytest.mark.parametrize("p", range(2, 6))
@pytest.mark.parametrize("m", range(1, 9))
def test_1f1b_matches_deepspeed_train_schedule(p: int, m: int) -> None:
    ours = generate("1f1b", p, m)
    for stage in range(p):
        assert [(a.kind.value, a.micro_batch) for a in ours.ranks[stage]] == _deepspeed_order(p, m, stage)
