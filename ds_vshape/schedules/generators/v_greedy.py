"""List scheduling on V placement for given pass costs: the orders the V schedules weigh against their blocks.

The building blocks of ``vshape`` are timed in the slot model, where F, B and W of a chunk take
one slot each. Real passes do not: B often costs more than F (attention's backward), and W much
less where the host is the bottleneck (its GEMMs issue fast, autograd's bookkeeping stays in B).
A slot-model order then makes a rank wait for a peer it planned to meet in the next slot, and
V-ZB, zero bubble with unit costs, can idle more than 1F1B does.

``v_greedy_schedule`` builds an order from the costs themselves, the zero-bubble papers' heuristic
carried to two chunks per rank: every rank, whenever it is free, runs a forward or an input
gradient whose inputs have arrived (by ``VGreedyPolicy``), and otherwise its oldest pending W.
Memory is counted as the V schedules count it (half an M_B per chunk's activation): B frees all
but the share ``costs.w_memory`` that W still needs, W frees that share, and the load of a rank,
F - B + w_memory (B - W), stays within the limit; so does F - W within twice it, a guard for a
runtime that keeps more until W than planned. A W is what makes room when the limit holds back
the next F, and what runs when nothing else is ready. A rank keeps ``reserve``
half-units free for its second chunk's forwards while it runs first-chunk forwards: the way back up
the V passes through every rank, and a rank filled with first-chunk activations would block it.

Pure: no process, no torch. Deterministic for given arguments (every rank builds the same order).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from ..costs import Costs
from ..ir import Action, Kind, Schedule
from ..placement import vshape

__all__ = ["VGreedyPolicy", "v_greedy_schedule"]

_EPS = 1e-9


@dataclass(frozen=True)
class VGreedyPolicy:
    """The choices of one greedy run.

    ``prioritise_b``: with an F and a B both ready, run the B (it is on the critical path back).
    ``greedy_fill``: with nothing ready, run a pending W even if a known pass arrives before it
    ends; off, the rank idles until that pass instead.
    ``later_chunk_first``: with two passes of one kind ready, run the later model stage's.
    ``reserve``: half-chunk activations a rank keeps free for its second chunk (see module doc).
    """

    prioritise_b: bool = True
    greedy_fill: bool = True
    later_chunk_first: bool = True
    reserve: int = 1

    @property
    def name(self) -> str:
        flags = "".join("1" if f else "0" for f in (self.prioritise_b, self.greedy_fill, self.later_chunk_first))
        return f"v-greedy-{flags}-r{self.reserve}"

    @classmethod
    def grid(cls) -> tuple[VGreedyPolicy, ...]:
        """Every combination of the four choices (reserve 1 or 2): the orders a V schedule tries."""
        return tuple(cls(*flags, reserve=r) for *flags, r in itertools.product((True, False), (True, False), (True, False), (1, 2)))


def v_greedy_schedule(p: int, m: int, *, costs: Costs, memory_limit: float, policy: VGreedyPolicy) -> Schedule | None:
    """One greedy run on V placement (two chunks per rank, no sequence chunks); ``memory_limit`` in M_B.

    None where the policy stalls (its memory rule leaves no runnable pass on some rank): the
    caller has other candidates, and a stall is a property of the policy at these sizes.
    """
    state = _State(p, m, costs, math.floor(2 * memory_limit + _EPS), policy)  # never above the limit
    if not state.run():
        return None
    return Schedule(policy.name, p, m, 2, 1, vshape(p), tuple(tuple(o) for o in state.orders))


@dataclass
class _State:
    """Discrete-event list scheduler: decisions only at times when a pass ends or a message lands."""

    p: int
    m: int
    costs: Costs
    limit: int  # half-chunk activations a rank may hold (the load, module doc)
    policy: VGreedyPolicy
    orders: list[list[Action]] = field(init=False)
    done: dict[tuple[Kind, int], int] = field(init=False)  # (kind, stage) -> passes run
    ends: dict[tuple[Kind, int, int], float] = field(default_factory=dict, init=False)
    free_at: list[float] = field(init=False)
    events: list[float] = field(default_factory=lambda: [0.0], init=False)
    pending: set[float] = field(default_factory=lambda: {0.0}, init=False)  # the times in ``events``, each once
    unfreed: list[int] = field(init=False)  # per rank: forwards whose B has not run
    awaiting_w: list[int] = field(init=False)  # per rank: B passes whose W has not run

    def __post_init__(self) -> None:
        self.placement: tuple[int, ...] = vshape(self.p)
        self.orders = [[] for _ in range(self.p)]
        self.done = {(kind, s): 0 for kind in (Kind.F, Kind.B, Kind.W) for s in range(2 * self.p)}
        self.free_at = [0.0] * self.p
        self.unfreed, self.awaiting_w = [0] * self.p, [0] * self.p
        self.stages: list[list[int]] = [[r, 2 * self.p - 1 - r] for r in range(self.p)]

    def run(self) -> bool:
        now, total = 0.0, 6 * self.m
        while any(len(o) < total for o in self.orders):
            while self._start_free_ranks(now):
                pass  # again at the same time: a zero-cost pass frees its rank at once
            while self.events and self.events[0] <= now + _EPS:
                self.pending.discard(heapq.heappop(self.events))
            if not self.events:
                return all(len(o) == total for o in self.orders)
            now = self.events[0]
        return True

    def _start_free_ranks(self, now: float) -> bool:
        started = False
        for r in range(self.p):
            if self.free_at[r] <= now + _EPS and len(self.orders[r]) < 6 * self.m:
                action = self._choose(r, now)
                if action is not None:
                    self._start(r, action, now)
                    started = True
        return started

    def _start(self, r: int, action: Action, now: float) -> None:
        end = now + self.costs.duration(action, chunks_per_rank=2, seq_chunks=1)
        self.orders[r].append(action)
        self.done[(action.kind, action.stage)] += 1
        self.ends[(action.kind, action.stage, action.micro_batch)] = end
        self.free_at[r] = end
        if action.kind is Kind.F:
            self.unfreed[r] += 1
        elif action.kind is Kind.B:
            self.unfreed[r], self.awaiting_w[r] = self.unfreed[r] - 1, self.awaiting_w[r] + 1
        else:
            self.awaiting_w[r] -= 1
        for t in (end, end + self.costs.comm):
            if t not in self.pending:  # many passes end at the same time: one wake-up each
                self.pending.add(t)
                heapq.heappush(self.events, t)

    def _arrival(self, kind: Kind, s: int) -> float | None:
        """When stage s's next F or B may start as far as its inputs go (None: not yet known)."""
        i = self.done[(kind, s)]
        if kind is Kind.F:
            if i >= self.m:
                return None
            prev = None if s == 0 else (Kind.F, s - 1, i)
        else:
            if i >= self.done[(Kind.F, s)]:
                return None
            prev = (Kind.F, s, i) if s == 2 * self.p - 1 else (Kind.B, s + 1, i)
        if prev is None:
            return 0.0
        end = self.ends.get(prev)
        if end is None:
            return None
        return end + (self.costs.comm if self.placement[prev[1]] != self.placement[s] else 0.0)

    def _candidates(self, r: int) -> list[tuple[Kind, int, float | None]]:
        out = []
        load = self.unfreed[r] + self.costs.w_memory * self.awaiting_w[r]
        held = self.unfreed[r] + self.awaiting_w[r]
        for s in self.stages[r]:
            out.append((Kind.B, s, self._arrival(Kind.B, s)))
            room = self.policy.reserve if s < self.p else 0
            if load + 1 + room <= self.limit + _EPS and held + 1 <= 2 * self.limit:
                out.append((Kind.F, s, self._arrival(Kind.F, s)))
        return out

    def _choose(self, r: int, now: float) -> Action | None:
        cands = self._candidates(r)
        ready = [(kind, s) for kind, s, at in cands if at is not None and at <= now + _EPS]
        if ready:
            first = Kind.B if self.policy.prioritise_b else Kind.F
            kind, s = min(ready, key=lambda c: (c[0] is not first, -c[1] if self.policy.later_chunk_first else c[1]))
            return Action(kind, s, self.done[(kind, s)])
        pending = [s for s in self.stages[r] if self.done[(Kind.W, s)] < self.done[(Kind.B, s)]]
        if not pending:
            return None
        s = min(pending, key=lambda st: self.ends[(Kind.B, st, self.done[(Kind.W, st)])])  # the oldest B's W
        w = Action(Kind.W, s, self.done[(Kind.W, s)])
        if not self.policy.greedy_fill:
            known = [at for _, _, at in cands if at is not None]
            if known and min(known) < now + self.costs.duration(w, chunks_per_rank=2, seq_chunks=1) - _EPS:
                return None  # idle briefly rather than delay a pass that is about to land
        return w
