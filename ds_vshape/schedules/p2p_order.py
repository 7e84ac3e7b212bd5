"""One order of transfers per pair of ranks, issued identically by both (NCCL's contract).

NCCL ignores tags: between two ranks the i-th send pairs with the i-th receive. And the
operations of one pair run one after another, in the order each rank issued them, with a
send finishing only once its receive is posted. So both ranks of a pair must issue their
transfers to each other in the same order (one's sends are the other's receives), or data
lands in the wrong buffer or both wait forever.

``pair_orders`` fixes that order from a run of the schedule in which every pass takes unit
time: transfers between two ranks are ordered by the moment their sender sends them (ties
broken by the sender's rank). A rank's own sends keep their place right after the pass
that makes them. ``place_posts`` then issues each receive (a non-blocking post) somewhere
between the rank's previous and next operation with that peer in the pair order, and no
later than the pass that needs the data; within that window it follows ``lookahead`` (keep
that many receives posted ahead, so data lands while the rank computes, without holding
buffers for the whole step). The runtime waits on a receive only right before its pass.
``group_crossing`` issues a receive and the send right after it to the same peer as one
group, so the two directions of a pair flow at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

from .costs import Costs
from .ir import Action, Schedule
from .ops import POSTS, SENDS, WAITS, Op, OpKind
from .simulate import simulate

__all__ = ["Pair", "Transfer", "TransferOrderError", "pair_orders", "place_posts", "group_crossing"]

Transfer = tuple[str, int, int, int]  # Op.transfer: (direction, consuming stage, micro-batch, chunk)
Pair = tuple[int, int]  # (lower rank, higher rank)
PairOrder = tuple[tuple[int, Transfer], ...]  # (sending rank, transfer), in the order both ranks issue them


class TransferOrderError(ValueError):
    """The transfers of two ranks cannot be issued in one order both agree on."""


def pair_orders(schedule: Schedule, programs: Sequence[tuple[Action, ...]], sends_of) -> dict[Pair, PairOrder]:
    """Every pair's transfers in the order both ranks issue them.

    ``programs``: each rank's action order as lowered; ``sends_of(rank, action)``: the sends
    that action makes (the lowering's own rule, so there is one definition of a send).
    """
    sim = simulate(replace(schedule, ranks=tuple(programs)), Costs())
    timed: dict[Pair, list[tuple[float, int, Transfer]]] = defaultdict(list)
    for rank, timeline in enumerate(sim.timeline):
        for _start, end, action in timeline:
            for op in sends_of(rank, action):
                timed[(min(rank, op.peer), max(rank, op.peer))].append((end, rank, op.transfer))
    return {pair: tuple((src, t) for _end, src, t in sorted(items)) for pair, items in sorted(timed.items())}


def place_posts(ops: list[Op], rank: int, orders: Mapping[Pair, PairOrder], *, lookahead: int = 2) -> list[Op]:
    """Insert a POST for every receive, in pair order, at or before the op that waits on it."""
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    waits = [i for i, op in enumerate(ops) if op.kind in WAITS]
    wait_at = {ops[i].transfer: i for i in waits}
    send_at = {op.transfer: i for i, op in enumerate(ops) if op.kind in SENDS}
    desired = {ops[w].transfer: (waits[n - lookahead] + 1 if n >= lookahead else 0) for n, w in enumerate(waits)}
    headers = {ops[w].transfer for w in waits if ops[w].header}
    before: dict[int, list[tuple[int, int, Op]]] = defaultdict(list)  # op index -> posts issued right before it
    for (a, b), order in orders.items():
        if rank in (a, b):
            peer = b if rank == a else a
            for pos, x, t in _positions(rank, peer, order, send_at, wait_at, desired, headers):
                before[pos].append((x, peer, _post_of(ops[wait_at[t]])))
    if len(sum(before.values(), [])) != len(waits):
        raise TransferOrderError(f"pipeline rank {rank}: {len(waits)} receives but {len(sum(before.values(), []))} appear in the pair orders")
    out: list[Op] = []
    for i, op in enumerate(ops):
        # Posts to the peer of a send at i go last, so they can be issued together with it.
        sent_to = op.peer if op.kind in SENDS else None
        out.extend(post for *_, post in sorted(before.get(i, []), key=lambda item: (item[1] == sent_to, item[1], item[0])))
        out.append(op)
    return out


def _positions(rank: int, peer: int, order: PairOrder, send_at: dict, wait_at: dict, desired: dict,
               headers: set[Transfer]) -> list[tuple[int, int, Transfer]]:
    """For each receive of this pair: (index of the op it is posted before, pair position, transfer).

    A post before op j comes before a send at j; so a post must sit after the previous send
    of the pair (j > s) and before the next one (j <= s), after the previous post (j >= j')
    and no later than its own wait. After a receive that brings the shapes, later posts of
    the pair wait (where they may) until that receive's own wait: posting them earlier would
    make the runtime block on reading the shapes before the rank needs them.
    """
    n = len(order)
    upper: list[int] = [0] * n
    bound = 1 << 62
    for x in reversed(range(n)):
        src, t = order[x]
        upper[x] = send_at[t] if src == rank else min(_need(wait_at, t, rank, peer), bound)
        bound = upper[x]
    placed: list[tuple[int, int, Transfer]] = []
    low, last_send, after_shapes = 0, -1, 0
    for x, (src, t) in enumerate(order):
        if src == rank:
            s = send_at[t]
            if s < low or s <= last_send:
                raise TransferOrderError(_conflict(rank, peer, order, x))
            low, last_send = s + 1, s
            continue
        pos = min(max(desired[t], low, after_shapes), upper[x])
        if pos < low:
            raise TransferOrderError(_conflict(rank, peer, order, x))
        placed.append((pos, x, t))
        low = pos
        if t in headers:
            after_shapes = wait_at[t]
    return placed


def _need(wait_at: dict, t: Transfer, rank: int, peer: int) -> int:
    if t not in wait_at:
        raise TransferOrderError(f"pipeline rank {rank}: rank {peer} sends {_text(t)} but rank {rank} never receives it")
    return wait_at[t]


def _post_of(wait: Op) -> Op:
    return replace(wait, kind=OpKind.POST_ACT if wait.kind is OpKind.RECV_ACT else OpKind.POST_GRAD)


def group_crossing(ops: list[Op]) -> list[Op]:
    """Mark a post directly followed by a send to the same peer: the two go out as one group.

    Not when the receive brings the shapes: its payload can only be posted once they are
    read, and it must precede the send on the pair.
    """
    out = list(ops)
    for i in range(len(ops) - 1):
        post, send = ops[i], ops[i + 1]
        if post.kind in POSTS and send.kind in SENDS and post.peer == send.peer and not post.header:
            out[i] = replace(post, with_next=True)
    return out


def _text(t: Transfer) -> str:
    direction, stage, mb, chunk = t
    return f"{'activations' if direction == 'act' else 'gradients'} of stage {stage} micro-batch {mb}" + (f" chunk {chunk}" if chunk else "")


def _conflict(rank: int, peer: int, order: PairOrder, x: int) -> str:
    src, t = order[x]
    what = "send" if src == rank else "receive"
    return (f"pipeline rank {rank}: cannot issue the {what} of {_text(t)} (position {x} of the transfers with rank {peer}) "
            f"in the order both ranks share; the schedule's order on rank {rank} contradicts it. This is a lowering bug: "
            "please report it with the schedule's `ds-vshape export` output")
