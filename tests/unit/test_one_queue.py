"""One hardware queue per rank (``CUDA_DEVICE_MAX_CONNECTIONS=1``): the checker's model, the
global transfer order, and the runtime's choice between the two orders.

Pure sweeps of ``check_transfers(one_queue=True)`` (every transfer of a rank on one ordered
queue, every stream-ordered wait a host wait for what comes after it, a header read before
the next transfer with any peer) over every schedule, p = 2..8, training and evaluation,
static and dynamic shapes; hand-built op lists the one-queue model must reject where pair
communicators would not; ``schedules/one_queue.py``'s order;
``runtime/program/transfer_order.use_global_order``, the runtime's choice; and the runtime's
header read before a transfer with any peer (``torch.distributed``'s batch call stood in for).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_vshape.runtime.program import transfer_order
from ds_vshape.runtime.transfers import comm
from ds_vshape.runtime.transfers.device import one_hardware_queue
from ds_vshape.schedules import generate, get_info, schedule_names
from ds_vshape.schedules.lowering import _keys, programs
from ds_vshape.schedules.ops import POSTS, SENDS, Op, OpKind
from ds_vshape.schedules.p2p_check import check_transfers
from ds_vshape.schedules.p2p_order import TransferOrderError
from tests.unit.test_p2p_waits import NcclLikeWork
from tests.unit.schedule_sizes import sizes

LOOPED = ("interleaved", "breadth-first")


def _fails(progs: list[list[Op]], **model: Any) -> bool:
    try:
        check_transfers(progs, **model)
    except TransferOrderError:
        return True
    return False


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_runs_under_one_queue_in_the_order_the_runtime_picks(name: str) -> None:
    # The runtime keeps the default order where it is safe and switches to the global order
    # where it is not; either way the order it runs passes the one-queue model. Looped
    # placements at p >= 3 are the ones that need the switch.
    for p, m, extra in sizes(name, one_above_least=True):
        schedule = generate(name, p, m, **extra)
        for train in (True, False):
            for dynamic in (False, True):
                switch = transfer_order.use_global_order(schedule, train=train, dynamic_shapes=dynamic, one_queue=True)
                if name not in LOOPED:
                    assert not switch, (name, p, m, train, dynamic)
                check_transfers(programs(schedule, train=train, one_queue=switch), one_queue=True, dynamic_shapes=dynamic)


@pytest.mark.parametrize("name", schedule_names())
def test_the_global_order_is_also_safe_with_pair_communicators(name: str) -> None:
    for p, m, extra in sizes(name, one_above_least=True)[::2]:
        schedule = generate(name, p, m, **extra)
        for train in (True, False):
            progs = programs(schedule, train=train, one_queue=True)
            check_transfers(progs)
            check_transfers(progs, dynamic_shapes=True)


@pytest.mark.parametrize("name", LOOPED)
def test_looped_default_orders_deadlock_under_one_queue_at_p3_and_up(name: str) -> None:
    # What the GPU run found under the emulation: pair communicators keep these orders safe,
    # one queue per rank does not (training and evaluation), and the global order is safe.
    for p in (3, 4, 8):
        m = max(get_info(name).min_micro_batches(p, get_info(name).chunks(None), 1), 2 * p)
        schedule = generate(name, p, m)
        for train in (True, False):
            default = programs(schedule, train=train)
            check_transfers(default)
            assert _fails(default, one_queue=True), (name, p, train)
            check_transfers(programs(schedule, train=train, one_queue=True), one_queue=True)


def test_the_checker_names_the_rank_queue_in_a_one_queue_deadlock() -> None:
    progs = programs(generate("interleaved", 4, 8))
    with pytest.raises(TransferOrderError, match="deadlock") as err:
        check_transfers(progs, one_queue=True)
    assert "on stream rank queue" in str(err.value)


def test_dynamic_headers_deadlock_interleaved_default_order_and_the_runtime_switches() -> None:
    # Every receive carrying a header (dynamic shapes): interleaved's default order blocks on
    # a header read at p = 3, even with pair communicators; the global order does not.
    schedule = generate("interleaved", 3, 6)
    assert _fails(programs(schedule), dynamic_shapes=True)
    assert transfer_order.use_global_order(schedule, train=True, dynamic_shapes=True, one_queue=False)
    check_transfers(programs(schedule, one_queue=True), dynamic_shapes=True)
    assert not transfer_order.use_global_order(schedule, train=True, dynamic_shapes=False, one_queue=False)


def _op(kind: OpKind, stage: int, peer: int, *, header: bool = False) -> Op:
    return Op(kind, stage, 0, peer=peer, header=header)


def _ring(header: bool = False) -> list[list[Op]]:
    # Rank 0 posts its receive from rank 2 first, then sends to rank 1; ranks 1 and 2 pass it on.
    return [
        [_op(OpKind.POST_ACT, 3, 2), _op(OpKind.SEND_ACT, 1, 1), _op(OpKind.RECV_ACT, 3, 2)],
        [_op(OpKind.POST_ACT, 1, 0, header=header), _op(OpKind.RECV_ACT, 1, 0), _op(OpKind.SEND_ACT, 2, 2)],
        [_op(OpKind.POST_ACT, 2, 1), _op(OpKind.RECV_ACT, 2, 1), _op(OpKind.SEND_ACT, 3, 0)],
    ]


def test_a_receive_posted_on_one_pair_holds_back_a_send_to_another_only_under_one_queue() -> None:
    check_transfers(_ring())  # pair communicators: rank 0's send to rank 1 is not behind its receive
    with pytest.raises(TransferOrderError, match="rank 0 on stream rank queue"):
        check_transfers(_ring(), one_queue=True)


def test_dynamic_shapes_make_every_receive_block_like_a_header() -> None:
    # The shapes-cycle of test_p2p_order, with the header flag off: only dynamic_shapes adds it.
    from tests.unit.test_p2p_order import _shapes_cycle

    check_transfers(_shapes_cycle(header=False))
    assert _fails(_shapes_cycle(header=False), dynamic_shapes=True)


def test_the_global_order_issues_every_ranks_transfers_sorted_by_one_key() -> None:
    for name, p, m in (("interleaved", 4, 8), ("breadth-first", 4, 8), ("v-zb", 4, 8), ("zb-h1", 3, 6)):
        schedule = generate(name, p, m)
        keys = _keys(schedule, True)
        for rank, ops in enumerate(programs(schedule, one_queue=True)):
            issued = [keys[op.transfer] for op in ops if op.kind in SENDS | POSTS]
            assert issued == sorted(issued), (name, rank)


def test_the_runtime_reads_one_queue_from_cuda_device_max_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert not one_hardware_queue()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert not one_hardware_queue()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert one_hardware_queue()
    schedule = generate("breadth-first", 4, 8)
    assert transfer_order.use_global_order(schedule, train=True, dynamic_shapes=False)
    assert not transfer_order.use_global_order(generate("1f1b", 4, 8), train=True, dynamic_shapes=False)


def test_the_switch_is_logged_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(transfer_order.logger, "warning", said.append)
    transfer_order._decide.cache_clear()
    assert transfer_order.use_global_order(generate("interleaved", 4, 12), train=False, dynamic_shapes=False, one_queue=True)
    assert len(said) == 1
    for needle in ("'interleaved'", "p=4", "evaluation", "CUDA_DEVICE_MAX_CONNECTIONS=1", "one global transfer order"):
        assert needle in said[0], said[0]


def _issued_order(monkeypatch: pytest.MonkeyPatch, *, one_queue: bool) -> list[tuple[str, int, int]]:
    """(kind, peer, number of tensors) of each batch a P2P issues: a header receive from rank 0, then a send to rank 2."""
    issued: list[tuple[str, int, int]] = []

    def batch_isend_irecv(ops: list[Any]) -> list[NcclLikeWork]:
        for op in ops:
            if op.tensor.dtype == torch.int64 and op.tensor.numel() == 64 and op.op is dist.irecv:
                op.tensor.copy_(comm._encode_header([torch.zeros(2, 3)], torch.device("cpu")))
        issued.append(("recv" if ops[0].op is dist.irecv else "send", ops[0].peer, len(ops)))
        work = NcclLikeWork()
        work.done = True
        return [work]

    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    p2p = comm.P2P(global_rank_of=[0, 1, 2], groups={0: "g01", 2: "g12"}, device=torch.device("cpu"), timeout_s=5.0,
                   my_rank=1, dynamic_shape=True, stream_waits=True, one_queue=one_queue)
    p2p.start_step()
    p2p.post(comm.Recv(comm.ACT, stage=1, micro_batch=0, seq_chunk=0, peer=0, header=True))
    p2p.send(comm.ACT, (torch.ones(2, 3),), stage=2, micro_batch=0, seq_chunk=0, peer=2, header=True)
    return issued


def test_with_one_queue_the_runtime_reads_a_header_before_a_transfer_with_any_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pair streams: the payload from rank 0 waits for the next operation with rank 0. One
    # queue: it is posted before the send to rank 2, as the checker's one-queue model assumes.
    assert _issued_order(monkeypatch, one_queue=False) == [("recv", 0, 1), ("send", 2, 2)]
    assert _issued_order(monkeypatch, one_queue=True) == [("recv", 0, 1), ("recv", 0, 1), ("send", 2, 2)]
