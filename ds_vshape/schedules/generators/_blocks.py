"""The building-block framework behind the V-shape schedules (Qi et al., arXiv 2405.15362).

A *building block* gives, for every rank, the slot of the four critical passes of
micro-batch 0: forward and backward of the rank's first chunk (F0, B0, model stage r) and
of its second chunk (F1, B1, model stage 2p-1-r). Micro-batch i repeats the block every
``PERIOD`` slots, so each rank's order of F and B passes follows from the block alone, and
so does its activation memory: what a block keeps in flight is decided by its lifespan.

Timing works in the *slot model*: every pass of one chunk (F, B or W) takes one slot, the
unit-cost case of the paper. ``squeeze`` then

1. moves every pass as early as its prerequisites allow, keeping each rank's order;
2. fills a bubble with a later pass of the same rank that is already runnable (the paper's
   greedy reordering) when doing so keeps the rank within the activation budget ``cap``;
3. places the W passes into the slots that are still free, oldest first.

Memory is counted in half-chunk activations (one F of one chunk = 1 = M_B/2). A W still
needs the inputs of the weight GEMMs, so B frees only the share ``1 - w_memory`` of its
activation and W the rest: the *load* of a rank is F - B + w_memory * (B - W), the
simulator's count with ``kept_until_w=w_memory``. The budget ``cap`` bounds the load;
``w_cap`` separately bounds F minus W (everything kept until W), a guard for a runtime
that keeps more than planned. A W placed late in a gap is therefore also forced in early:
when the next F would break either bound, the rank runs its oldest pending W instead.
With ``w_memory=0`` that only happens at ``w_cap``, so the W passes fill gaps as before.

Sequence chunks: with k chunks per micro-batch the framework runs on the m k units of
``_seq_units`` (each 1/k of a micro-batch, one slot per pass). ``shift_backward`` moves
every B k-1 periods later, so that B1 of a unit follows the forward of its micro-batch's
last chunk in the order; ``squeeze(seq_chunks=k)`` makes the backward at the V's turn wait
for that forward too, and names the passes after their (micro-batch, chunk).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ..ir import Action, Kind
from ._seq_units import last_forward_unit, unit_action

__all__ = [
    "PERIOD", "F0", "F1", "B1", "B0", "Block", "Order", "Record", "Squeezed",
    "vmin_block", "vhalf_block", "offset_block", "check_block", "shift_backward", "repeat", "order_peak", "squeeze",
]

PERIOD = 6  # a rank runs six passes per micro-batch: F0, F1, B1, B0 and the two W
F0, F1, B1, B0 = range(4)

Block = tuple[tuple[int, int, int, int], ...]  # per rank: slot of F0, F1, B1, B0 of micro-batch 0
Order = list[tuple[int, int]]  # per rank: (pass code, micro-batch) in run order

_NEVER = 1 << 62  # "not ready yet" for a pass's ready slot
_EPS = 1e-9  # loads are sums of multiples of a float share; compare with a tolerance
# Dependency chain of one micro-batch through the V: F0 down the ranks, F1 back up,
# B1 down again and B0 back up. ``True`` walks ranks from p-1 to 0.
_CHAIN = ((F0, False), (F1, True), (B1, False), (B0, True))


# ---- blocks ------------------------------------------------------------------------------
def vmin_block(p: int) -> Block:
    """V-Min: the tightest chain, one slot per hop (REFERENCE section 2, stable offsets).

    The gap g moves B1 off a residue that F0 or F1 already uses when 3 divides p.
    """
    g = 2 if p % 3 == 0 else 0
    return tuple((i, 2 * p - 1 - i, 2 * p + g + i, 4 * p + g - 1 - i) for i in range(p))


def vhalf_block(p: int) -> Block:
    """V-Half: F0 and B1 advance two slots per hop, which doubles rank 0's lifespan."""
    g = 3 if p % 2 == 0 else 0
    return tuple((2 * i, 3 * p - 2 - i, 3 * p - 1 + g + 2 * i, 6 * p - 2 + g - i) for i in range(p))


def offset_block(
    p: int, base: Sequence[int], first: Sequence[int], rest: Sequence[int], n_first: int
) -> Block | None:
    """The paper's uniform-offset family (its Appendix A).

    ``base`` holds rank 0's residues (F0, F1, B1, B0) within a period; rank i takes rank
    i-1's residues shifted by ``first`` for i <= n_first and by ``rest`` after. Offsets
    [k, -1, k, -1] let F0 and B1 wait k slots per hop, which stretches the lifespan and so
    buys memory for fewer bubbles. None when two passes of one rank share a residue.
    """
    residues = [tuple(x % PERIOD for x in base)]
    for i in range(1, p):
        step = first if i <= n_first else rest
        nxt = tuple((residues[-1][c] + step[c]) % PERIOD for c in range(4))
        if len(set(nxt)) < 4:
            return None
        residues.append(nxt)
    return None if len(set(residues[0])) < 4 else _chain(residues)


def _chain(residues: Sequence[Sequence[int]]) -> Block:
    """Absolute slots of micro-batch 0: each pass takes the first slot with its residue
    after the pass it depends on, walking the V's dependency chain."""
    p = len(residues)
    slots = [[0] * 4 for _ in range(p)]
    t = -1
    for code, upward in _CHAIN:
        for r in (reversed(range(p)) if upward else range(p)):
            t += 1 + (residues[r][code] - t - 1) % PERIOD
            slots[r][code] = t
    return tuple((s[0], s[1], s[2], s[3]) for s in slots)


def check_block(block: Block) -> None:
    """Raise ValueError unless repeating the block is itself a valid timing: every pass
    after its prerequisite and the four passes of a rank on distinct residues."""
    p = len(block)
    prev = -1
    for code, upward in _CHAIN:
        for r in (reversed(range(p)) if upward else range(p)):
            if block[r][code] <= prev:
                raise ValueError(f"block breaks the dependency chain at rank {r}, pass {code}: {block}")
            prev = block[r][code]
    for r, slots in enumerate(block):
        if len({s % PERIOD for s in slots}) < 4:
            raise ValueError(f"block puts two passes of rank {r} on one residue: {slots}")


def shift_backward(block: Block, k: int) -> Block:
    """The block with B1 and B0 k-1 periods later (residues kept, so still a valid block):
    backward unit u waits for forward unit u + k - 1 at most (``_seq_units``)."""
    if k < 1:
        raise ValueError(f"seq_chunks must be >= 1, got {k}")
    delay = PERIOD * (k - 1)
    return tuple((f0, f1, b1 + delay, b0 + delay) for f0, f1, b1, b0 in block)


def repeat(block: Block, m: int) -> list[Order]:
    """Each rank's F/B order: micro-batch i's passes sit at the block's slots + PERIOD * i."""
    orders = []
    for slots in block:
        timed = sorted((s + PERIOD * i, code, i) for code, s in enumerate(slots) for i in range(m))
        orders.append([(code, i) for _, code, i in timed])
    return orders


def order_peak(orders: Sequence[Order]) -> int:
    """Largest number of half-chunk activations in flight (F done, B not) on any rank."""
    peak = 0
    for order in orders:
        level = 0
        for code, _ in order:
            level += 1 if code in (F0, F1) else -1
            peak = max(peak, level)
    return peak


# ---- squeeze -----------------------------------------------------------------------------
Record = tuple[int, int, int, int]  # (slot, kind, stage, micro_batch); kind 0 F, 1 B, 2 W
_F, _B, _W = 0, 1, 2
_KINDS = (Kind.F, Kind.B, Kind.W)


@dataclass(frozen=True)
class Squeezed:
    """A timed slot-model schedule: each rank's records in run order, over units of
    ``seq_chunks`` sequence chunks per micro-batch (1: units are micro-batches)."""

    records: tuple[tuple[Record, ...], ...]
    seq_chunks: int = 1

    @property
    def span_idle(self) -> tuple[int, ...]:
        """Idle slots between each rank's own first and last pass (the paper's count)."""
        return tuple(rec[-1][0] + 1 - rec[0][0] - len(rec) for rec in self.records)

    @property
    def makespan_idle(self) -> tuple[int, ...]:
        """Idle slots of each rank from slot 0 to the end of the step."""
        end = max(rec[-1][0] + 1 for rec in self.records)
        return tuple(end - len(rec) for rec in self.records)

    @property
    def score(self) -> tuple[int, int]:
        """What the search minimises: worst span idle, then worst makespan idle."""
        return max(self.span_idle), max(self.makespan_idle)

    def peak(self, *, w_memory: float = 0.0) -> float:
        """Half-chunk activations held (of whole micro-batches), max over ranks, when B frees
        ``1 - w_memory`` of its unit's activation and W the rest (1: everything until W)."""
        freed = {_F: -1.0, _B: 1.0 - w_memory, _W: w_memory}
        peak = 0.0
        for rec in self.records:
            level = 0.0
            for _, kind, _, _ in rec:
                level -= freed[kind]
                peak = max(peak, level)
        return peak / self.seq_chunks

    def actions(self) -> tuple[tuple[Action, ...], ...]:
        k = self.seq_chunks
        return tuple(tuple(unit_action(_KINDS[kind], stage, u, k) for _, kind, stage, u in rec) for rec in self.records)


def squeeze(
    p: int,
    m: int,
    orders: Sequence[Order],
    *,
    cap: int,
    w_cap: int,
    w_memory: float = 0.0,
    give_up: int | None = None,
    seq_chunks: int = 1,
) -> Squeezed | None:
    """Time the orders in slots: squeeze, fill bubbles within ``cap``, place W (module doc).

    ``cap`` must be at least ``order_peak(orders)`` (the block's own peak) and ``w_cap`` at
    least ``cap``: then a rank always has a pass it may run, a W that makes room, or waits
    on another rank, so the result is complete and deadlock-free. Every F keeps the load
    (``w_memory``'s share held until W) within ``cap`` and F minus W within ``w_cap``.
    ``give_up``: return None as soon as a rank has idled more than this many slots inside
    its span (a search drops hopeless blocks). ``seq_chunks``: k > 1 reads ``m`` as units
    (module doc); the orders must come from a block passed through ``shift_backward``.
    """
    if cap < order_peak(orders) or w_cap < cap:
        raise ValueError(f"need order peak <= cap <= w_cap, got peak {order_peak(orders)}, cap {cap}, w_cap {w_cap}")
    if not 0.0 <= w_memory <= 1.0:
        raise ValueError(f"w_memory must be in [0, 1], got {w_memory}")
    state = _Squeezer(p, m, orders, cap, w_cap, w_memory, seq_chunks)
    left = 3 * 2 * p * m  # F, B and W of both chunks, per rank and micro-batch
    t = 0
    while left:
        ran = sum(state.step(r, t) for r in range(p))
        if not ran:  # nothing new can become ready, so nothing ever will: a bug, not bad input
            raise RuntimeError(f"squeeze stalled at slot {t} with {left} passes left (cap {cap}, w_cap {w_cap})")
        left -= ran
        t += 1
        if give_up is not None and t % PERIOD == 0 and state.idled(t) > give_up:
            return None
    return Squeezed(tuple(tuple(rec) for rec in state.records), seq_chunks)


class _Squeezer:
    """Mutable state of one squeeze. Pass keys: kind * n + stage * m + micro_batch with
    kind 0 = F and 1 = B, so a pass and the one it unblocks are one key step apart."""

    def __init__(
        self, p: int, m: int, orders: Sequence[Order], cap: int, w_cap: int, w_memory: float, k: int
    ) -> None:
        self.p, self.m, self.n, self.k = p, m, 2 * p * m, k
        self.cap, self.w_cap, self.w = cap, w_cap, w_memory
        self.keys = [[self._key(r, code, i) for code, i in order] for r, order in enumerate(orders)]
        self.delta = [[1 if code in (F0, F1) else -1 for code, _ in order] for order in orders]
        self.pos = [0] * (2 * self.n)
        for keys in self.keys:
            for j, key in enumerate(keys):
                self.pos[key] = j
        self.ready = [_NEVER] * (2 * self.n)  # slot from which a pass may start
        self.avail: list[list[int]] = [[] for _ in range(p)]  # keys made ready, maybe run since
        self.done = [[False] * len(order) for order in orders]
        self.head = [0] * p
        self.level = [0] * p
        self.backlog: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]  # (stage, mb) awaiting W
        self.records: list[list[Record]] = [[] for _ in range(p)]
        self.rank_of = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
        for i in range(m):
            self.ready[i] = 0  # stage 0's forwards wait for nothing
            self.avail[0].append(i)

    def _key(self, r: int, code: int, i: int) -> int:
        stage = r if code in (F0, B0) else 2 * self.p - 1 - r
        return (0 if code in (F0, F1) else self.n) + stage * self.m + i

    def idled(self, t: int) -> int:
        """Most idle slots any rank has had inside its span before slot t; a rank that has
        more to run will keep them, a finished one keeps its final count."""
        worst = 0
        for rec in self.records:
            if rec:
                end = rec[-1][0] + 1 if len(rec) == 3 * 2 * self.m else t
                worst = max(worst, end - rec[0][0] - len(rec))
        return worst

    def step(self, r: int, t: int) -> int:
        """Let rank r use slot t; returns 1 when it ran a pass."""
        keys, done, n = self.keys[r], self.done[r], self.n
        h = self.head[r]
        while h < len(keys) and done[h]:
            h += 1
        self.head[r] = h
        backlog = self.backlog[r]
        load, limit = self._budget(r)
        full = load + 1 > limit + _EPS  # another F would break a bound: a W must make room first
        if h < len(keys) and self.ready[keys[h]] <= t and not (full and keys[h] < n):
            j = h
        else:
            j = self._pick(r, h, t, load, limit)
        if j < 0:
            if not backlog:
                return 0
            stage, i = backlog.popleft()
            self.records[r].append((t, _W, stage, i))
            return 1
        key = keys[j]
        done[j] = True
        self.level[r] += self.delta[r][j]
        stage, i = divmod(key % n, self.m)
        if key < n:  # F: the next stage's forward, or after the last stage the B it unblocks
            unblocked = [key + self.m] if stage < 2 * self.p - 1 else self._turn(i)
            self.records[r].append((t, _F, stage, i))
        else:  # B: the previous stage's backward, and this unit's W
            unblocked = [key - self.m] if stage > 0 else []
            self.records[r].append((t, _B, stage, i))
            backlog.append((stage, i))
        for nxt in unblocked:
            self.ready[nxt] = t + 1
            self.avail[self.rank_of[(nxt % n) // self.m]].append(nxt)
        return 1

    def _turn(self, unit: int) -> list[int]:
        """B keys of the last stage that the forward of ``unit`` on it unblocks: its own B,
        or with k chunks all k backward units of its micro-batch once its last chunk is in."""
        if last_forward_unit(unit, self.k) != unit:
            return []
        first = unit - (self.k - 1)
        last_stage = 2 * self.p - 1
        return [self.n + last_stage * self.m + u for u in range(first, unit + 1)]

    def _budget(self, r: int) -> tuple[float, float]:
        """(load, limit): the rank's load now and how high an F may take it.

        The load is F - B + w * backlog. F minus W is that plus (1 - w) * backlog, so
        ``w_cap`` caps the load at ``w_cap - (1 - w) * backlog``; with w = 0 this is the
        plain F - B level against ``min(cap, w_cap - backlog)``.
        """
        backlog = len(self.backlog[r])
        load = self.level[r] + self.w * backlog
        return load, min(self.cap, self.w_cap - (1.0 - self.w) * backlog)

    def _pick(self, r: int, h: int, t: int, load: float, limit: float) -> int:
        """Position of a later runnable pass to pull into slot t, or -1.

        A B first (it frees memory and unblocks the rank below); else the earliest F, if
        starting it now keeps the rank's load within ``limit`` until its own place in the
        order. Only the earliest F needs the test: a later one spans the same levels.
        """
        best_b = best_f = -1
        keep = []
        done, pos, ready, n = self.done[r], self.pos, self.ready, self.n
        for key in self.avail[r]:
            j = pos[key]
            if done[j]:
                continue
            keep.append(key)
            if ready[key] > t:
                continue
            if key >= n:
                best_b = j if best_b < 0 else min(best_b, j)
            else:
                best_f = j if best_f < 0 else min(best_f, j)
        self.avail[r] = keep
        if best_b >= 0:
            return best_b
        return best_f if best_f >= 0 and self._room(r, h, best_f, load, limit) else -1

    def _room(self, r: int, h: int, j: int, load: float, limit: float) -> bool:
        """True when running the F at position j now keeps the load within ``limit`` at
        every pass up to j, if no W runs meanwhile (each B then frees only 1 - w)."""
        if load + 1 > limit + _EPS:
            return False
        delta, done, kept = self.delta[r], self.done[r], self.w
        for x in range(h, j):
            if not done[x]:
                load += delta[x] if delta[x] > 0 else delta[x] * (1.0 - kept)
                if load + 1 > limit + _EPS:
                    return False
        return True
