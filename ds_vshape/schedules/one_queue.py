"""Transfer orders that stay safe when a rank has one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``).

With one hardware queue per GPU (Megatron-DeepSpeed's launch scripts set
``CUDA_DEVICE_MAX_CONNECTIONS=1``), every NCCL operation of a rank runs in issue order on one
queue, whatever its communicator, and a stream-ordered wait holds back everything issued after
it, as a host wait would. NCCL promises no concurrent progress of two communicators either
(NVIDIA/nccl issue 783). Pair communicators then do not keep a receive posted from one
neighbour from holding back a send to the other: the orders ``p2p_order.place_posts`` makes
for looped placements (interleaved, breadth-first) deadlock there
(``p2p_check.check_transfers(one_queue=True)`` finds them).

The fix, as torch's looped schedules do with every transfer on one communicator: one global
order of all transfers of the step, and every rank issues its own transfers (sends and
receive posts) in that order. The order is the one ``p2p_order.pair_orders`` already uses per
pair, made global: by the moment the sender sends in a run of the schedule with unit-time
passes, ties broken by the sender's rank, then by the transfer. Every pair's order is a
restriction of it, so the two ranks of a pair still agree.

Why it cannot deadlock (rendezvous sends, waits right before the consuming pass): take the
earliest transfer T of the global order not yet done. Its sender issued it, or its host is
blocked on a receive it needs first, which the run of the schedule puts earlier than T (a pass
starts after its input arrived and sends after it ends), so that one is done. Its receiver
posted it, or its host waits on a receive posted before T, hence earlier, hence done. Both
queues hold only done transfers ahead of T, so T runs.

A receive's post goes between the rank's last send that comes before it in the global order
and its first send that comes after it (and no later than its wait); within that window it
follows ``lookahead`` as ``place_posts`` does. Pure: imports neither torch.distributed nor
deepspeed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from .costs import Costs
from .ir import Action, Schedule
from .ops import SENDS, WAITS, Op, OpKind
from .p2p_order import Transfer, TransferOrderError
from .simulate import simulate

__all__ = ["GlobalKey", "place_posts_in_global_order", "transfer_keys"]

GlobalKey = tuple[float, int, Transfer]  # (send moment in the unit-time run, sending rank, transfer)


def transfer_keys(schedule: Schedule, programs: Sequence[tuple[Action, ...]],
                  sends_of: Callable[[int, Action], list[Op]]) -> dict[Transfer, GlobalKey]:
    """Every transfer of the step with its place in the one global order (sort by the key)."""
    sim = simulate(replace(schedule, ranks=tuple(programs)), Costs())
    keys: dict[Transfer, GlobalKey] = {}
    for rank, timeline in enumerate(sim.timeline):
        for _start, end, action in timeline:
            for op in sends_of(rank, action):
                keys[op.transfer] = (end, rank, op.transfer)
    return keys


def place_posts_in_global_order(ops: list[Op], rank: int, keys: Mapping[Transfer, GlobalKey], *,
                                lookahead: int = 2) -> list[Op]:
    """Insert a POST for every receive so that the rank's sends and posts follow ``keys``' order."""
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    sends = [(i, _key(keys, op, rank)) for i, op in enumerate(ops) if op.kind in SENDS]
    for (i, a), (j, b) in zip(sends, sends[1:]):
        if b < a:
            raise TransferOrderError(f"pipeline rank {rank}: its sends at ops {i} and {j} contradict the global transfer "
                                     "order (a lowering bug: please report it with `ds-vshape export`)")
    waits = [i for i, op in enumerate(ops) if op.kind in WAITS]
    desired = {ops[w].transfer: (waits[n - lookahead] + 1 if n >= lookahead else 0) for n, w in enumerate(waits)}
    ordered = sorted(waits, key=lambda i: _key(keys, ops[i], rank))
    highs = [min([w] + [i for i, k in sends if k > _key(keys, ops[w], rank)]) for w in ordered]
    for x in reversed(range(len(highs) - 1)):  # a post must also precede every later post of the order
        highs[x] = min(highs[x], highs[x + 1])
    before: dict[int, list[Op]] = defaultdict(list)
    pos = 0
    for w, high in zip(ordered, highs):
        key = _key(keys, ops[w], rank)
        low = 1 + max((i for i, k in sends if k < key), default=-1)
        floor = max(low, pos)  # after the previous post: posts follow the global order too
        pos = min(max(desired[ops[w].transfer], floor), high)
        if pos < floor:
            raise TransferOrderError(f"pipeline rank {rank}: no place for the receive of {ops[w].transfer} in the global "
                                     "transfer order (a lowering bug: please report it with `ds-vshape export`)")
        before[pos].append(_post_of(ops[w]))
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.extend(before.get(i, ()))
        out.append(op)
    return out


def _key(keys: Mapping[Transfer, GlobalKey], op: Op, rank: int) -> GlobalKey:
    key = keys.get(op.transfer)
    if key is None:
        raise TransferOrderError(f"pipeline rank {rank}: {op} is not in the step's global transfer order")
    return key


def _post_of(wait: Op) -> Op:
    return replace(wait, kind=OpKind.POST_ACT if wait.kind is OpKind.RECV_ACT else OpKind.POST_GRAD)
