"""NCCL's first contact: which pairs warm up at initialize, in which order, and why.

Pure checks of ``schedules/first_contact.py`` and of the checker's first-contact rule
(``check_transfers(first_contact=True)``): looped placements at p >= 3 hang on their first
transfers without a warm-up, every schedule runs once its pairs are connected, and the warm-up
walk in one global order cannot hang where a per-rank order can. Then the runtime's side with
``torch.distributed`` stood in for: ``P2P.warm_up`` issues one batch per peer in the order
given, on the pair's group; the device and wait choices of ``transfers/device.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_vshape.runtime.transfers import device as device_mod
from ds_vshape.runtime.transfers.comm import P2P
from ds_vshape.runtime.transfers.p2p_groups import neighbour_pairs
from ds_vshape.schedules import generate, linear, looped, schedule_names, vshape
from ds_vshape.schedules.first_contact import contact_pairs, first_peers, warm_up_peers
from ds_vshape.schedules.lowering import programs
from ds_vshape.schedules.ops import Op, OpKind
from ds_vshape.schedules.p2p_check import check_transfers
from ds_vshape.schedules.p2p_order import TransferOrderError
from tests.unit.schedule_sizes import sizes

LOOPED = ("interleaved", "breadth-first")


# ---- which pairs, which order ---------------------------------------------------------------
@pytest.mark.parametrize("name", schedule_names())
def test_the_pairs_that_warm_up_are_the_pairs_the_runtime_makes_groups_for(name: str) -> None:
    for p, m, extra in sizes(name):
        schedule = generate(name, p, m, **extra)
        for train in (True, False):
            assert contact_pairs(programs(schedule, train=train)) == tuple(neighbour_pairs(schedule.stage_to_rank)), (p, m)


def test_every_rank_walks_the_pairs_in_one_sorted_order() -> None:
    pairs = [(2, 3), (0, 3), (1, 2), (0, 1)]  # interleaved at p=4, unsorted
    assert [warm_up_peers(pairs, r) for r in range(4)] == [(1, 3), (0, 2), (1, 3), (0, 2)]
    assert warm_up_peers([(3, 0), (1, 0)], 0) == (1, 3)  # a pair given high rank first is the same pair
    assert warm_up_peers(pairs, 7) == ()
    with pytest.raises(ValueError, match="names one rank twice"):
        warm_up_peers([(1, 1)], 1)


def test_interleaved_first_receives_form_a_cycle() -> None:
    # Rank 0 first reaches rank 3 (the wrap-around), rank 1 rank 0, rank 2 rank 1, rank 3 rank 2.
    firsts = [first_peers(ops)[0] for ops in programs(generate("interleaved", 4, 8))]
    assert firsts == [3, 0, 1, 2]


# ---- the checker's first-contact rule ------------------------------------------------------
@pytest.mark.parametrize("name", LOOPED)
def test_looped_schedules_hang_on_first_contact_without_the_warm_up(name: str) -> None:
    for p in (3, 4, 8):
        schedule = generate(name, p, 2 * p)
        with pytest.raises(TransferOrderError, match="blocked in first contact with rank"):
            check_transfers(programs(schedule), first_contact=True)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "v-zb", "v-half"])
def test_linear_and_v_schedules_meet_first_contact_even_without_it(name: str) -> None:
    check_transfers(programs(generate(name, 4, 8)), first_contact=True)


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_runs_under_first_contact_once_its_pairs_are_connected(name: str) -> None:
    for p, m, extra in sizes(name):
        for train in (True, False):
            progs = programs(generate(name, p, m, **extra), train=train)
            check_transfers(progs, first_contact=True, connected=contact_pairs(progs))


def _exchange(rank: int, peer: int) -> list[Op]:
    """One warm-up exchange as the checker sees it: both directions, then the host waits."""
    out, back = Op(OpKind.SEND_ACT, peer, rank, peer=peer), Op(OpKind.POST_ACT, rank, peer, peer=peer)
    if rank < peer:
        return [out, back, Op(OpKind.RECV_ACT, rank, peer, peer=peer)]
    return [Op(OpKind.POST_ACT, rank, peer, peer=peer, with_next=True), out, Op(OpKind.RECV_ACT, rank, peer, peer=peer)]


def _walk(peers_of: list[tuple[int, ...]]) -> list[list[Op]]:
    return [[op for peer in peers for op in _exchange(rank, peer)] for rank, peers in enumerate(peers_of)]


PLACEMENTS: dict[str, Callable[[int], tuple[int, ...]]] = {"linear": linear, "looped": lambda p: looped(p, 2),
                                                          "vshape": vshape}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_warm_up_in_one_global_order_never_hangs(placement: str) -> None:
    for p in range(2, 9):
        pairs = neighbour_pairs(PLACEMENTS[placement](p))
        check_transfers(_walk([warm_up_peers(pairs, r) for r in range(p)]), first_contact=True)


def test_a_warm_up_in_per_rank_orders_can_hang() -> None:
    # Each rank first greets the rank before it on the ring: the cycle the global order avoids.
    ring = [((r - 1) % 4, (r + 1) % 4) for r in range(4)]
    with pytest.raises(TransferOrderError, match="first contact"):
        check_transfers(_walk(ring), first_contact=True)


# ---- the runtime: P2P.warm_up with torch.distributed stood in for ------------------------------
class _DoneWork:
    def __init__(self) -> None:
        self.waits: list[Any] = []

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        self.waits.append(timeout)
        return True


def test_warm_up_exchanges_once_with_each_peer_in_order_on_the_pairs_group(monkeypatch: pytest.MonkeyPatch) -> None:
    batches: list[list[tuple[str, int, Any, tuple[int, ...]]]] = []
    works: list[_DoneWork] = []

    def batch_isend_irecv(ops: list[Any]) -> list[_DoneWork]:
        batches.append([("send" if op.op is dist.isend else "recv", op.peer, op.group, tuple(op.tensor.shape)) for op in ops])
        works.append(_DoneWork())
        return [works[-1]]

    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    p2p = P2P(global_rank_of=[10, 11, 12, 13], groups={1: "g01", 3: "g03"}, device=torch.device("cpu"), timeout_s=5.0, my_rank=0)
    p2p.warm_up(warm_up_peers([(0, 1), (1, 2), (2, 3), (0, 3)], 0))
    assert batches == [[("send", 11, "g01", (1,)), ("recv", 11, "g01", (1,))], [("send", 13, "g03", (1,)), ("recv", 13, "g03", (1,))]]
    assert all(len(w.waits) == 1 and w.waits[0] is not None for w in works)  # waited on the host, with the timeout
    assert p2p.inflight == []


# ---- the device a rank uses, and how it waits ----------------------------------------------------
def test_a_device_rank_other_than_local_rank_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "5")
    assert device_mod.check_device_rank(None) == 1
    assert device_mod.check_device_rank(SimpleNamespace(device_rank=1)) == 1
    assert device_mod.check_device_rank(SimpleNamespace(device_rank=None)) == 1
    with pytest.raises(ValueError) as err:
        device_mod.check_device_rank(SimpleNamespace(device_rank=0))
    for needle in ("rank 5", "args.device_rank=0", "LOCAL_RANK=1", "CUDA_VISIBLE_DEVICES"):
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize(("config", "device", "stream"), [
    ("cpu:gloo,cuda:nccl", "cuda", True), ("cpu:gloo,cuda:nccl", "cpu", False), ("cuda:nccl", "cuda", True),
    ("cpu:gloo,cuda:gloo", "cuda", False), ("cpu:gloo,cuda:gloo", "cpu", False), ("nccl", "cuda", True),
])
def test_waits_follow_the_backend_of_the_tensors_device(monkeypatch: pytest.MonkeyPatch, config: str, device: str,
                                                        stream: bool) -> None:
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert device_mod.waits_on_stream(torch.device(device)) is stream
