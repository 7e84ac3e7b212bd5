"""Check lowered op lists against NCCL's point-to-point rules, without any process.

Two checks over every rank's ops (``programs``):

* **mirror**: for each pair of ranks, the transfers one issues to the other (sends and
  receive posts, in order) are the other's, with sends and receives swapped. NCCL matches
  the i-th send with the i-th receive regardless of tags, so anything else misroutes data.
* **progress**: an event-driven run of what the runtime issues finishes. Each communicator
  is one stream per rank (torch's ProcessGroupNCCL), on which entries run in issue order,
  each to completion before the next; the runtime (``runtime/transfers/comm.py``) gives every pair of
  ranks a 2-rank group of its own and batches every operation on it, so by default a rank
  has one stream per peer (``communicator=pair_communicator``). An entry is one operation
  or one group (``Op.with_next``); a send completes only together with its receive
  (rendezvous). A rank's later work waits where the runtime waits: for a receive before the
  pass that needs it, and, after posting a receive that brings the shapes, before its next
  operation with that peer (the payload can only be posted once the shapes are read on the
  host). A stream-ordered wait (NCCL) orders later operations exactly like a host wait: an
  operation issued after it starts only after the compute stream passed it. The step tail
  (reduces, optimizer step) is a barrier of all ranks.

``communicator`` says which stream a rank uses for a peer; ``world_communicator`` (every
transfer on one group, as DeepSpeed's world group would be) shows the orders that pair
groups make safe.

``one_queue=True`` is the model for one hardware queue per rank (``CUDA_DEVICE_MAX_CONNECTIONS=1``,
and NCCL's own caveat that two communicators need not progress concurrently): every
transfer of a rank, whatever its communicator, goes on one ordered queue, and every
stream-ordered wait is a host wait for what is issued after it. The runtime's header read
then comes before the rank's next transfer with any peer, not just that peer.
``dynamic_shapes=True``: every receive brings a header (``dynamic_shape`` modules, unequal
sequence chunks), so each one blocks as a header does.

``synchronize_at`` names op kinds before which the rank makes a device-wide synchronize (ZeRO-3's
coalesced all-gather at ``gather_params``, ZeRO-2's ``allreduce_and_copy`` at
``reduce_stage_grads``): such an op is issued only once
every transfer the rank issued before it completed, posted receives and unmatched sends included.

``first_contact=True`` adds NCCL's connection rule (``first_contact`` module): a rank's first
operation with a peer on a stream blocks its host until that peer's host reaches its own
first operation with it there. ``connected`` names the pairs of ranks already connected on
their stream (the runtime's warm-up at initialize connects every pair the programs use).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from .ops import POSTS, SENDS, WAITS, Op, OpKind
from .p2p_order import TransferOrderError

__all__ = ["Communicator", "check_transfers", "pair_communicator", "rank_queue", "world_communicator"]

Communicator = Callable[[int, int], Hashable]  # (rank, peer) -> the stream's key


def pair_communicator(rank: int, peer: int) -> Hashable:
    """One 2-rank group per pair: what the runtime issues on."""
    return (min(rank, peer), max(rank, peer))


def world_communicator(rank: int, peer: int) -> Hashable:
    """Every transfer on one shared group (one stream per rank)."""
    return "world"


def rank_queue(rank: int, peer: int) -> Hashable:
    """One hardware queue per rank: every transfer of a rank in one order, whatever its communicator."""
    return "rank queue"


_TAIL = frozenset({OpKind.REDUCE_TIED_GRADS, OpKind.REDUCE_GRADS, OpKind.OPTIMIZER_STEP})


def check_transfers(programs: Sequence[Sequence[Op]], *, communicator: Communicator = pair_communicator,
                    first_contact: bool = False, connected: Iterable[tuple[int, int]] = (), one_queue: bool = False,
                    dynamic_shapes: bool = False, synchronize_at: Iterable[OpKind] = ()) -> None:
    """Raise ``TransferOrderError`` naming the ranks and operations when a rule is broken.

    ``one_queue``: one ordered queue per rank (overrides ``communicator``); ``dynamic_shapes``:
    every receive brings a header; ``synchronize_at``: op kinds preceded by a device-wide synchronize."""
    _check_mirror(programs)
    if one_queue:
        communicator = rank_queue
    run = _Run(programs, communicator, first_contact=first_contact, one_queue=one_queue, dynamic_shapes=dynamic_shapes,
               synchronize_at=frozenset(synchronize_at))
    for a, b in connected:
        run.connected |= {(a, b, communicator(a, b)), (b, a, communicator(b, a))}
    run.run()


def _pair_ops(ops: Sequence[Op], peer: int) -> list[tuple[str, tuple]]:
    return [("send" if op.kind in SENDS else "recv", op.transfer) for op in ops if op.kind in SENDS | POSTS and op.peer == peer]


def _check_mirror(programs: Sequence[Sequence[Op]]) -> None:
    flip = {"send": "recv", "recv": "send"}
    for a in range(len(programs)):
        for b in range(a + 1, len(programs)):
            mine = [(flip[kind], t) for kind, t in _pair_ops(programs[a], b)]
            theirs = _pair_ops(programs[b], a)
            if mine == theirs:
                continue
            x = next((i for i, (u, v) in enumerate(zip(mine, theirs)) if u != v), min(len(mine), len(theirs)))
            got_a = f"{flip[mine[x][0]]} {mine[x][1]}" if x < len(mine) else "nothing"
            got_b = f"{theirs[x][0]} {theirs[x][1]}" if x < len(theirs) else "nothing"
            raise TransferOrderError(
                f"ranks {a} and {b} disagree on their transfer order at position {x}: rank {a} issues {got_a}, "
                f"rank {b} issues {got_b}. NCCL pairs them by position, so the data would be misrouted or both would wait"
            )


@dataclass
class _Entry:
    kind: str  # "send" or "recv"
    transfer: tuple
    peer: int
    done: bool = False


@dataclass
class _Run:
    programs: Sequence[Sequence[Op]]
    communicator: Communicator
    host: list[int] = field(default_factory=list)
    queues: dict[tuple[int, Hashable], deque[list[_Entry]]] = field(default_factory=dict)  # (rank, stream)
    received: set[tuple[int, tuple]] = field(default_factory=set)
    shapes_pending: dict[tuple[int, int], tuple] = field(default_factory=dict)  # (rank, peer) -> header receive
    held: dict[int, tuple[int, _Entry]] = field(default_factory=dict)  # rank -> (peer, post issued with the next send)
    first_contact: bool = False
    connected: set[tuple[int, int, Hashable]] = field(default_factory=set)  # (rank, peer, stream) past first contact
    contacting: dict[int, tuple[int, Hashable]] = field(default_factory=dict)  # rank -> (peer, stream) its host waits at
    one_queue: bool = False  # a pending header blocks the rank's next transfer with any peer
    dynamic_shapes: bool = False  # every receive brings a header
    synchronize_at: frozenset[OpKind] = frozenset()  # op kinds preceded by a device-wide synchronize

    def run(self) -> None:
        self.host = [0] * len(self.programs)
        while True:
            moved = any([self._advance(r) for r in range(len(self.programs))])
            moved = self._match() or moved
            if not moved:
                break
        stuck = [r for r, ops in enumerate(self.programs) if self.host[r] < len(ops)]
        queued = {k: q for k, q in self.queues.items() if q}
        if stuck or queued:
            raise TransferOrderError(self._deadlock(stuck, queued))

    def _advance(self, r: int) -> bool:
        ops, moved = self.programs[r], False
        while self.host[r] < len(ops) and self._can_issue(r, ops[self.host[r]]):
            self._issue(r, ops[self.host[r]])
            self.host[r] += 1
            moved = True
        return moved

    def _can_issue(self, r: int, op: Op) -> bool:
        if op.kind in WAITS:
            return (r, op.transfer) in self.received
        if op.kind in SENDS | POSTS:
            return not self._header_pending(r, op.peer) and self._contact(r, op.peer)
        if op.kind in self.synchronize_at and not self._idle(r):
            return False
        if op.kind in _TAIL:
            return all(self._at_tail(q) for q in range(len(self.programs)))
        return True

    def _idle(self, r: int) -> bool:
        """Whether every transfer ``r`` issued has completed (what a device-wide synchronize waits for)."""
        return r not in self.held and not any(q for (rank, _), q in self.queues.items() if rank == r)

    def _header_pending(self, r: int, peer: int) -> bool:
        """Whether ``r``'s host must first read a header: from ``peer`` (one stream per pair) or from anyone (one queue)."""
        if self.one_queue:
            return any(rank == r for rank, _ in self.shapes_pending)
        return (r, peer) in self.shapes_pending

    def _contact(self, r: int, peer: int) -> bool:
        """Under the first-contact rule: whether ``r`` may issue to ``peer`` now (both hosts met)."""
        stream = self.communicator(r, peer)
        if not self.first_contact or (r, peer, stream) in self.connected:
            return True
        self.contacting[r] = (peer, stream)
        if self.contacting.get(peer) != (r, stream):
            return False
        self.connected |= {(r, peer, stream), (peer, r, stream)}
        del self.contacting[r], self.contacting[peer]
        return True

    def _at_tail(self, q: int) -> bool:
        ops = self.programs[q]
        return self.host[q] >= len(ops) or ops[self.host[q]].kind in _TAIL

    def _issue(self, r: int, op: Op) -> None:
        if op.kind not in SENDS | POSTS:
            if r in self.held:
                raise TransferOrderError(f"pipeline rank {r}: a receive marked to go with the next send is followed by {op}")
            return
        entry = _Entry("send" if op.kind in SENDS else "recv", op.transfer, op.peer)
        header = op.kind in POSTS and (op.header or self.dynamic_shapes)
        if header:
            self.shapes_pending[(r, op.peer)] = op.transfer
        if op.with_next and not header:  # the runtime issues a header's receive alone
            self.held[r] = (op.peer, entry)
            return
        group = [entry]
        if r in self.held:
            peer, first = self.held.pop(r)
            if peer != op.peer or op.kind not in SENDS:
                raise TransferOrderError(f"pipeline rank {r}: a receive from rank {peer} marked to go with the next send is followed by {op}")
            group.insert(0, first)
        self.queues.setdefault((r, self.communicator(r, op.peer)), deque()).append(group)

    def _match(self) -> bool:
        moved = False
        for (r, comm), queue in self.queues.items():
            for e in queue[0] if queue else ():
                other = self.queues.get((e.peer, comm))
                if e.done or not other:
                    continue
                f = next((f for f in other[0] if not f.done and f.peer == r and f.kind != e.kind and f.transfer == e.transfer), None)
                if f is not None:
                    e.done = f.done = True
                    receiver, sender = (r, e.peer) if e.kind == "recv" else (e.peer, r)
                    self.received.add((receiver, e.transfer))
                    if self.shapes_pending.get((receiver, sender)) == e.transfer:
                        del self.shapes_pending[(receiver, sender)]
                    moved = True
        for queue in self.queues.values():
            while queue and all(e.done for e in queue[0]):
                queue.popleft()
                moved = True
        return moved

    def _deadlock(self, stuck: list[int], queued: dict) -> str:
        lines = ["the transfers deadlock under NCCL's rules (issue order per communicator stream, rendezvous):"]
        for r in stuck:
            lines.append(f"  rank {r} waits at op {self.host[r]}: {self.programs[r][self.host[r]]}")
            if r in self.contacting:
                peer, stream = self.contacting[r]
                lines.append(f"    its host is blocked in first contact with rank {peer} on stream {stream} "
                             f"(until rank {peer} makes its own first call with rank {r} there)")
        for (r, comm), queue in sorted(queued.items(), key=str):
            head = ", ".join(f"{e.kind} {e.transfer} with rank {e.peer}" for e in queue[0] if not e.done)
            lines.append(f"  rank {r} on stream {comm}: {len(queue)} queued, first: {head}")
        return "\n".join(lines)
