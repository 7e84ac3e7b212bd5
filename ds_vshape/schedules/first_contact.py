"""First contact between pipeline ranks: which pairs connect before a step, and in what order.

NCCL connects a pair's point-to-point channels on their first exchange on a communicator,
on the host, inside the call that issues it: that call returns only once the peer has made
its own first call with this rank on the same communicator (``REFERENCE.md`` section 7).
Left to the step, each rank's first call with a peer is wherever its lowered program puts
the first transfer with it, usually a posted receive at the very start; on a looped
placement at p >= 3 (interleaved, breadth-first) rank 0 first receives from rank p-1, rank
p-1 from rank p-2, ..., rank 1 from rank 0: a cycle, and no rank's first call returns.

So the runtime makes every first contact at initialize, before any step: each pair of
pipeline ranks that the lowered programs exchange on, once, both directions in one batch,
waited on the host. Every rank walks the same list of pairs, sorted, skipping the pairs it
is not in. The earliest pair of that list not yet connected has both of its ranks at it
(each has connected every earlier pair of its own), so the walk always moves on: it cannot
form a cycle. ``p2p_check.check_transfers(first_contact=True)`` checks orders under this
rule, with or without the pairs already connected.

Pure: imports neither torch.distributed nor deepspeed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .ops import POSTS, SENDS, Op

__all__ = ["Pair", "contact_pairs", "first_peers", "warm_up_peers"]

Pair = tuple[int, int]  # (lower pipeline rank, higher pipeline rank)


def contact_pairs(programs: Sequence[Sequence[Op]]) -> tuple[Pair, ...]:
    """Every pair of pipeline ranks that some rank's lowered ops send to or receive from, sorted."""
    pairs = {(min(rank, op.peer), max(rank, op.peer))
             for rank, ops in enumerate(programs) for op in ops if op.kind in SENDS | POSTS and op.peer is not None}
    return tuple(sorted(pairs))


def warm_up_peers(pairs: Iterable[Pair], rank: int) -> tuple[int, ...]:
    """The peers ``rank`` makes first contact with at initialize, in the one global order.

    ``pairs``: the same collection on every rank (``contact_pairs``); it is sorted here, so
    every rank follows one order whatever order it was given in.
    """
    ordered = sorted((min(a, b), max(a, b)) for a, b in pairs)
    if any(a == b for a, b in ordered):
        raise ValueError(f"a pair of pipeline ranks names one rank twice: {[p for p in ordered if p[0] == p[1]]}")
    return tuple(b if a == rank else a for a, b in ordered if rank in (a, b))


def first_peers(ops: Sequence[Op]) -> tuple[int, ...]:
    """The peers a rank's lowered ops would first reach without a warm-up, in that order."""
    seen: dict[int, None] = {}
    for op in ops:
        if op.kind in SENDS | POSTS and op.peer is not None:
            seen.setdefault(op.peer)
    return tuple(seen)
