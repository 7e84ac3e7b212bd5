"""Zero-bubble schedules (Qi et al., ICLR 2024) on linear placement, backward split into B and W.

B (gradient w.r.t. the stage input) stays on the critical path; W (gradient w.r.t. the
weights) depends on nothing downstream, so it is moved into the slots where 1F1B idles.

* ``zb-h1``: 1F1B's memory (peak p M_B); step time m(T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W).
* ``zb-h2``: peak 2p-1 M_B; no idle slot inside any rank's span with unit costs: each
  rank's span is m(T_F+T_B+T_W) + (p-1)(T_F+T_B-2T_W) (the "parallelogram": rank r starts
  r T_F late, which the paper's optimizer post-validation overlaps with the previous step).
* Both take sequence chunks (``seq_chunks=k``): they then order the m k units (see
  ``_seq_units``) with k-1 more warm-up forwards per rank, the time the last chunk of a
  micro-batch takes to reach the last rank before its backward can start; W placement
  (each rank holds back the same W passes) is unchanged. Peak p-1+k and 2p-2+k units
  of 1/k M_B each, at most the unchunked p and 2p-1.
* ``zb-auto``: for the given costs and memory limit, the best (by the simulator) of the
  orders from ZB-H1 to ZB-H2 and of the paper's greedy heuristic over a grid of policies.

Memory limits are counted conservatively: a micro-batch is live on a rank from its F until
its W, so a limit holds whatever share of the activation B keeps for W (the simulator's
``kept_until_w`` anywhere from 0 to 1). ZB-H1 and ZB-H2 reach exactly p and 2p-1 that way.
So these generators need not read ``costs.w_memory``: the count with any share lies
between the count freed at B and the count held until W, at every moment, and both stay
within the bound. They ignore it, and their orders do not depend on it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..costs import Costs
from ..ir import Action, B, F, Kind, Schedule, W
from ..placement import linear
from ..simulate import simulate
from .builtin import builtin
from ._seq_units import expand_units

__all__ = ["zb_h1", "zb_h2", "zb_auto", "GreedyPolicy", "greedy_schedule"]

_EPS = 1e-9


# ---- hand-crafted ZB-H1 / ZB-H2 -----------------------------------------------------------
@builtin(
    "zb-h1", aliases=("zb1p",), seq_chunks=True, split_backward=True, summary="zero bubble H1: 1F1B memory (p), W delayed into the bubbles"
)
def zb_h1(p: int, m: int, *, v: int = 1, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    # Rank r runs p-r forwards before its first B (1F1B's warm-up plus the F of the first
    # steady step) and holds back its first r W passes: those W fill the slots where 1F1B
    # waits for the returning gradient, which is what shortens the bubble by (p-1) T_W.
    return Schedule("zb-h1", p, m, 1, k, linear(p), _chunked(p, m, k, extra=0))


@builtin(
    "zb-h2",
    split_backward=True,
    aliases=("zb2p",),
    summary="zero bubble H2: peak 2p-1, no idle inside a rank's span with unit costs",
    min_micro_batches=lambda p, v, k: 2 * p - 1,
    seq_chunks=True,
)
def zb_h2(p: int, m: int, *, v: int = 1, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    # Rank r runs 2(p-1-r)+1 forwards, exactly enough to cover the time until its first
    # gradient returns; it then holds back 2r W passes so that B passes flow back at the pace
    # of the last rank. The order is its own mirror image (reverse it, swap F and W, swap rank
    # r and p-1-r), which is why the tail drains with no idle slot either: rank r ends with
    # 2r+1 W passes while the gradients of the last micro-batch travel up.
    if m < 2 * p - 1:
        raise ValueError(f"zb-h2 needs at least 2p-1 = {2 * p - 1} micro-batches for p={p}, got {m}; use zb-h1 or zb-auto")
    return Schedule("zb-h2", p, m, 1, k, linear(p), _chunked(p, m, k, extra=p - 1))


def _chunked(p: int, m: int, k: int, *, extra: int) -> tuple[tuple[Action, ...], ...]:
    """``_between_h1_and_h2`` over the m k units of k sequence chunks, renamed to real passes."""
    if k < 1:
        raise ValueError(f"zero-bubble schedules need seq_chunks >= 1, got {k}")
    orders = _between_h1_and_h2(p, m * k, extra=extra, extra_warmup=k - 1)
    return tuple(expand_units(order, k) for order in orders)


def _between_h1_and_h2(p: int, m: int, *, extra: int, extra_warmup: int = 0) -> tuple[tuple[Action, ...], ...]:
    """ZB-H1 (extra 0) to ZB-H2 (extra p-1): rank r runs min(extra, p-1-r) more warm-up
    forwards and holds back min(extra, r) more W passes, for a peak of p + min(2 extra, p-1).
    ``extra_warmup`` adds the same number of warm-up forwards on every rank (k-1 with k
    sequence chunks, where ``m`` counts units).

    Warm-up never grows down the ranks, so no rank waits on a forward that its neighbour
    only runs after a gradient that waits on it: every ``extra`` gives a valid order.
    """
    return tuple(
        _delayed_w_order(r, m, warmup=p - r + min(extra, p - 1 - r) + extra_warmup, w_delay=r + min(extra, r))
        for r in range(p)
    )


def _delayed_w_order(r: int, m: int, *, warmup: int, w_delay: int) -> tuple[Action, ...]:
    """``warmup`` forwards, then per step ``B`` (+ ``W`` once ``w_delay`` steps have passed) ``F``.

    F, B and W each take micro-batches in increasing order; the W passes held back are run
    at the end, where the rank would otherwise wait for the last gradients. W goes before
    the step's F so that a W frees its micro-batch before the next one is admitted: the
    peak then holds even counting a micro-batch as live until its W (it takes the same time
    as ``B F W`` for any costs with T_W <= T_B).
    """
    order: list[Action] = [F(r, i) for i in range(min(warmup, m))]
    next_f, next_w = len(order), 0
    for step in range(m):
        order.append(B(r, step))
        if step >= w_delay:
            order.append(W(r, next_w))
            next_w += 1
        if next_f < m:
            order.append(F(r, next_f))
            next_f += 1
    order += [W(r, i) for i in range(next_w, m)]
    return tuple(order)


# ---- zb-auto: greedy heuristic over a grid of policies -----------------------------------
@builtin(
    "zb-auto",
    split_backward=True,
    summary="zero bubble, greedy search over policies for the given costs and memory limit (default p)",
    uses_costs=True,
    memory_limit=True,
)
def zb_auto(p: int, m: int, *, v: int = 1, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    costs = costs or Costs()
    limit = float(p) if memory_limit is None else float(memory_limit)
    if limit < 1.0:
        raise ValueError(f"zb-auto needs a memory limit of at least 1 M_B (one micro-batch in flight), got {memory_limit}")
    best: tuple[tuple[float, float], Schedule] | None = None
    for candidate in _auto_candidates(p, m, costs, limit):
        result = simulate(candidate, costs, kept_until_w=1.0)  # live until W: the strictest count
        if result.max_peak_memory > limit + _EPS:
            continue
        key = (result.makespan, result.max_peak_memory)
        if best is None or key < best[0]:
            best = (key, candidate)
    assert best is not None, "the greedy always fits a limit >= 1"
    chosen = best[1]
    return Schedule("zb-auto", p, m, 1, 1, linear(p), chosen.ranks, params={"memory_limit": limit, "picked": chosen.name})


def _auto_candidates(p: int, m: int, costs: Costs, limit: float) -> Iterator[Schedule]:
    # The hand-crafted orders from ZB-H1 to ZB-H2 join the grid: the search is then never
    # worse than ZB-H1 (or ZB-H2, or a step between) whenever its memory fits, whatever the
    # costs do to the greedy's choices; the greedy covers limits below p and odd costs.
    for extra in range(p):
        name = {0: "zb-h1", p - 1: "zb-h2"}.get(extra, f"zb-h1+{extra}")
        yield Schedule(name, p, m, 1, 1, linear(p), _between_h1_and_h2(p, m, extra=extra))
    for policy in GreedyPolicy.grid():
        yield greedy_schedule(p, m, costs=costs, memory_limit=limit, policy=policy)


@dataclass(frozen=True)
class GreedyPolicy:
    """The booleans of the zero-bubble paper's heuristic.

    ``bubble_before_first_b``: a rank stops after 1F1B's p-r warm-up forwards and waits for
    its first gradient (less memory) instead of running forwards until it arrives.
    ``prioritise_b``: when both an F and a B are ready, run the B (critical path) first.
    ``greedy_fill``: when nothing on the critical path is ready, run a pending W even if a
    known F or B arrives before the W ends (no idle slot, but it delays that pass).
    A W is also what makes room when the memory limit holds back the next F.
    """

    bubble_before_first_b: bool = False
    prioritise_b: bool = True
    greedy_fill: bool = True

    @property
    def name(self) -> str:
        flags = (self.bubble_before_first_b, self.prioritise_b, self.greedy_fill)
        return "greedy-" + "".join("1" if f else "0" for f in flags)

    @classmethod
    def grid(cls) -> tuple[GreedyPolicy, ...]:
        return tuple(cls(*flags) for flags in itertools.product((False, True), repeat=3))


def greedy_schedule(
    p: int,
    m: int,
    *,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    policy: GreedyPolicy | None = None,
) -> Schedule:
    """One greedy list-scheduling run: per rank, pick F/B/W at each event time by ``policy``.

    ``memory_limit`` (in M_B, default p) caps the micro-batches between F and W on a rank.
    """
    limit = float(p if memory_limit is None else memory_limit)
    state = _GreedyState(p, m, costs or Costs(), limit, policy or GreedyPolicy())
    state.run()
    return Schedule(state.policy.name, p, m, 1, 1, linear(p), tuple(tuple(o) for o in state.orders))


@dataclass
class _GreedyState:
    """Discrete-event list scheduler: decisions are taken only at times when something ends
    (or a message lands), so every pass starts as soon as the policy allows it."""

    p: int
    m: int
    costs: Costs
    limit: float
    policy: GreedyPolicy
    orders: list[list[Action]] = field(init=False)
    counts: list[dict[Kind, int]] = field(init=False)
    free_at: list[float] = field(init=False)
    ends: dict[tuple[Kind, int, int], float] = field(default_factory=dict, init=False)
    events: list[float] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.orders = [[] for _ in range(self.p)]
        self.counts = [{Kind.F: 0, Kind.B: 0, Kind.W: 0} for _ in range(self.p)]
        self.free_at = [0.0] * self.p
        self.events = [0.0]

    def run(self) -> None:
        now = 0.0
        while not self._finished():
            while self._start_ready_ranks(now):
                pass  # again at the same time: a zero-cost pass frees its rank at once
            later = self._next_event_after(now)
            if later is None:
                raise RuntimeError(f"greedy scheduler stalled at t={now} with policy {self.policy}")  # a bug, not a user error
            now = later

    def _start_ready_ranks(self, now: float) -> bool:
        started = False
        for r in range(self.p):
            if self.free_at[r] <= now + _EPS and len(self.orders[r]) < 3 * self.m:
                action = self._choose(r, now)
                if action is not None:
                    self._start(r, action, now)
                    started = True
        return started

    def _finished(self) -> bool:
        return all(len(o) == 3 * self.m for o in self.orders)

    def _next_event_after(self, now: float) -> float | None:
        while self.events and self.events[0] <= now + _EPS:
            heapq.heappop(self.events)
        return self.events[0] if self.events else None

    def _start(self, r: int, action: Action, now: float) -> None:
        end = now + self.costs.duration(action, chunks_per_rank=1, seq_chunks=1)
        self.orders[r].append(action)
        self.counts[r][action.kind] += 1
        self.free_at[r] = end
        self.ends[(action.kind, r, action.micro_batch)] = end
        heapq.heappush(self.events, end)
        heapq.heappush(self.events, end + self.costs.comm)

    def _arrival(self, r: int, kind: Kind) -> float | None:
        """When the next F or B of rank r may start as far as other ranks go (None: unknown)."""
        c = self.counts[r]
        if kind is Kind.F:
            if r == 0:
                return 0.0
            end = self.ends.get((Kind.F, r - 1, c[Kind.F]))
        else:
            if r == self.p - 1:
                return 0.0  # the last stage's B needs only its own F, already done
            end = self.ends.get((Kind.B, r + 1, c[Kind.B]))
        return None if end is None else end + self.costs.comm

    def _candidates(self, r: int) -> dict[Kind, float | None]:
        """The passes rank r may run next (memory and warm-up rules applied), with arrivals."""
        c, out = self.counts[r], {}
        in_flight = c[Kind.F] - c[Kind.W]  # live until W: holds for any share B keeps for W
        warm_cap = self.policy.bubble_before_first_b and c[Kind.B] == 0 and c[Kind.F] >= self.p - r
        if c[Kind.F] < self.m and in_flight + 1 <= self.limit + _EPS and not warm_cap:
            out[Kind.F] = self._arrival(r, Kind.F)
        if c[Kind.B] < c[Kind.F]:
            out[Kind.B] = self._arrival(r, Kind.B)
        return out

    def _choose(self, r: int, now: float) -> Action | None:
        cands = self._candidates(r)
        ready = [kind for kind, at in cands.items() if at is not None and at <= now + _EPS]
        c = self.counts[r]
        if ready:
            if len(ready) == 2:
                kind = Kind.B if self.policy.prioritise_b else Kind.F
            else:
                kind = ready[0]
            return Action(kind, r, c[kind])
        if c[Kind.W] >= c[Kind.B]:
            return None
        w = Action(Kind.W, r, c[Kind.W])
        if not self.policy.greedy_fill:
            known = [at for at in cands.values() if at is not None]
            if known and min(known) < now + self.costs.duration(w, chunks_per_rank=1, seq_chunks=1) - _EPS:
                return None  # idle briefly rather than delay a pass that is about to land
        return w
