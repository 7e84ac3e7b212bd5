"""Device-wide synchronizes inside a step: the checker's model and the orders the runtime runs.

``get_accelerator().synchronize()`` waits for every transfer the rank has issued, posted
receives included: ZeRO-3's coalesced all-gather ends in one (``gather_params``), ZeRO-2's
``allreduce_and_copy`` too (``reduce_stage_grads``). ``check_transfers(synchronize_at=...)``
issues such an op only once every earlier transfer of the rank completed. Pure sweeps: every
schedule, p = 2..8, training and evaluation, pair communicators and one queue per rank, in the
order ``runtime/program/transfer_order.use_global_order`` picks for a ZeRO-3 engine, passes;
the looped default orders at p >= 3 would hang in their first gather, and the runtime switches.
"""

from __future__ import annotations

import pytest

from ds_vshape.runtime.program import transfer_order
from ds_vshape.schedules import generate, schedule_names
from ds_vshape.schedules.lowering import programs
from ds_vshape.schedules.ops import COMPUTE, DATA_PARALLEL, Op, OpKind
from ds_vshape.schedules.p2p_check import check_transfers
from ds_vshape.schedules.p2p_order import TransferOrderError
from tests.unit.schedule_sizes import sizes

LOOPED = ("interleaved", "breadth-first")
ZERO3 = DATA_PARALLEL  # gather_params, release_params, reduce_stage_grads: all acted on under ZeRO-3
ZERO2 = frozenset({OpKind.REDUCE_STAGE_GRADS})  # allreduce_and_copy's synchronize


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_survives_zero_synchronizes_in_the_order_the_runtime_picks(name: str) -> None:
    for p, m, extra in sizes(name):
        schedule = generate(name, p, m, **extra)
        for train in (True, False):
            for one_queue in (False, True):
                switch = transfer_order.use_global_order(schedule, train=train, dynamic_shapes=False, one_queue=one_queue,
                                                         synchronize_at=ZERO3)
                assert switch == (name in LOOPED and p >= 3), (name, p, m, train, one_queue)
                check_transfers(programs(schedule, train=train, one_queue=switch), one_queue=one_queue, synchronize_at=ZERO3)
            # ZeRO-2: its synchronize comes after a stage's last backward; only looped orders may need the switch.
            switch = transfer_order.use_global_order(schedule, train=train, dynamic_shapes=False, one_queue=False,
                                                     synchronize_at=ZERO2)
            assert name in LOOPED or not switch, (name, p, m, train)
            check_transfers(programs(schedule, train=train, one_queue=switch), synchronize_at=ZERO2)


@pytest.mark.parametrize("name", LOOPED)
def test_looped_default_orders_hang_in_their_first_zero3_gather_at_p3_and_up(name: str) -> None:
    # Rank 0 posts its receive from rank p-1 before its first gather; the gather's synchronize
    # waits for it, and rank p-1 needs rank 0's first forward to send it.
    schedule = generate(name, 4, 8)
    check_transfers(programs(schedule))
    with pytest.raises(TransferOrderError, match="rank 0 waits at op [0-9]+: gather_params s0"):
        check_transfers(programs(schedule), synchronize_at=ZERO3)
    check_transfers(programs(generate(name, 2, 4)), synchronize_at=ZERO3)  # p=2: the PP2xDP2 runs


@pytest.mark.parametrize("name", ["v-min", "zb-h1", "1f1b", "v-half"])
def test_a_synchronize_around_every_pass_is_safe_for_the_schedules_auto_warms_up_with(name: str) -> None:
    # What auto's warm-up timing did with a device-wide synchronize (it now waits on the current
    # stream only): safe for its safe schedules either way.
    for p in (2, 4, 8):
        check_transfers(programs(generate(name, p, 2 * p)), synchronize_at=COMPUTE)


def _op(kind: OpKind, stage: int, peer: int | None = None) -> Op:
    return Op(kind, stage, 0, peer=peer)


def test_a_synchronize_waits_for_a_receive_posted_ahead() -> None:
    # Rank 0 posts the gradient from rank 2, then synchronizes (a gather) before sending the
    # activations that rank 1, then rank 2, need to produce that gradient: a hang. Without the
    # synchronize the pair communicators keep it apart, fine.
    rank0 = [_op(OpKind.POST_GRAD, 0, 2), _op(OpKind.GATHER_PARAMS, 0), _op(OpKind.FORWARD, 0), _op(OpKind.SEND_ACT, 1, 1),
             _op(OpKind.RECV_GRAD, 0, 2)]
    rank1 = [_op(OpKind.POST_ACT, 1, 0), _op(OpKind.RECV_ACT, 1, 0), _op(OpKind.FORWARD, 1), _op(OpKind.SEND_ACT, 2, 2)]
    rank2 = [_op(OpKind.POST_ACT, 2, 1), _op(OpKind.RECV_ACT, 2, 1), _op(OpKind.FORWARD, 2), _op(OpKind.SEND_GRAD, 0, 0)]
    check_transfers([rank0, rank1, rank2])
    check_transfers([rank0, rank1, rank2], synchronize_at={OpKind.REDUCE_GRADS})  # no such op: no change
    with pytest.raises(TransferOrderError, match="rank 0 waits at op 1: gather_params"):
        check_transfers([rank0, rank1, rank2], synchronize_at={OpKind.GATHER_PARAMS})


def test_the_switch_names_zero_synchronize_as_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(transfer_order.logger, "warning", said.append)
    transfer_order._decide.cache_clear()
    assert transfer_order.use_global_order(generate("breadth-first", 3, 6), train=True, dynamic_shapes=False,
                                           one_queue=False, synchronize_at=ZERO3)
    ours = [text for text in said if "default transfer order" in text]  # DeepSpeed's logger: others may speak
    assert len(ours) == 1 and "device-wide synchronize at gather_params" in ours[0], said
