"""V-shape schedules with controllable memory (Qi, Wan, Amar, Lin, NeurIPS 2024, arXiv 2405.15362).

Every rank holds two chunks in V placement (rank r: model stages r and 2p-1-r) and splits
the backward into B and W. The schedules differ only in their building block, whose
lifespan sets the activation memory (see ``_blocks`` for the framework):

- ``v-min``: the tightest chain, one slot per hop; peak <= floor((p+4)/3) M_B.
- ``v-half``: F0 and B1 two slots per hop; peak <= floor((p+2)/2) M_B.
- ``v-zb`` (``zb-v``): offsets [5,-1,5,-1] on every rank; peak <= p M_B and, once m >= 2p,
  the least step time of any V schedule (6m + p - 1 slots); with ``w_memory`` 0 also no
  idle slot inside any rank's span.
- ``v-adaptive``: the lowest-bubble block of the offset family (plus the three above) whose
  peak fits ``memory_limit`` (in M_B, default p).

Peaks count what a real split backward holds: B frees its unit's activation except the
share ``costs.w_memory`` that W still needs, which W frees (the simulator's count with
``kept_until_w=costs.w_memory``, its default). The bounds above hold for any share in
[0, 1]: a W that would wait for a gap is run early instead when the next F would break
the budget. F minus W also never exceeds twice the budget, whatever the share. Those
early W passes cost bubbles: at m = 4p and p = 4/8/12, counted from slot 0, V-Min idles
11/25/41 slots at share 0.5 and 13/26/43 at 1 (7/21/31 at 0), V-Half 6/17/29 and
7/21/35 (5/13/21 at 0), while V-ZB keeps its step time and only moves up to p-1 idle
slots into the spans.

V-Min and V-Half are themselves members of the offset family: their REFERENCE offsets are
[1,-1,1,-1] and [2,-1,2,-1] from their own rank-0 residues (the unit tests check this).

Bubbles are counted as the paper counts them: idle slots inside each rank's own span, from
its first pass to its last. With optimizer post-validation a rank starts its next step as
soon as it ends this one, so the p-1 slots by which the last rank necessarily starts later
than rank 0 do not recur; ``span_idle`` gives that figure from a simulation. Counted from
slot 0 instead (``SimResult.idle``), no V schedule can go below p-1 slots per rank, and V-ZB
reaches exactly that.

``v-half``, ``v-zb`` and ``v-min`` take sequence chunks (``seq_chunks=k``): the block runs
on the m k units of k chunks per micro-batch (see ``_seq_units``), its B passes shifted k-1
periods later so the backward at the V's turn finds its micro-batch's last chunk forwarded.
Each unit holds 1/k of a micro-batch, and the budget (in micro-batches) is the unchunked
one, so the peak in M_B stays within the same bound.

All four are built in the slot model (unit pass costs, no communication), where ``costs.w_memory``
decides how early the W passes must run. Real passes are not equal: B often costs more than F, W
far less where the host is the bottleneck, and a slot-model order then waits on its peer (V-ZB can
idle more than 1F1B). So under ``costs`` with unequal F, B and W, a hop or uneven stages, each
schedule also tries the greedy orders of ``v_greedy`` within its own memory bound (counted as the
blocks are, with the share ``costs.w_memory`` held until W) and runs the one the simulator finds
fastest, the block's on a tie (``params["picked"]`` names a greedy winner). The blocks stay as the
papers built them under slot-model costs, even where a greedy order would be faster there, and with
sequence chunks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..costs import Costs
from ..ir import Action, Schedule
from ..placement import vshape
from ..simulate import SimResult, simulate
from .builtin import builtin
from .v_greedy import VGreedyPolicy, v_greedy_schedule
from . import _blocks as blocks

__all__ = [
    "v_zb", "v_half", "v_min", "v_adaptive", "vzb_block", "vmin_budget", "vhalf_budget", "span_idle",
]

_SUMMARY = "V placement, split backward; "
_EPS = 1e-9


def span_idle(result: SimResult) -> tuple[float, ...]:
    """Idle time inside each rank's own span (its first pass's start to its last pass's end)."""
    return tuple((t[-1][1] - t[0][0]) - sum(e - s for s, e, _ in t) if t else 0.0 for t in result.timeline)


def vzb_block(p: int) -> blocks.Block:
    """V-ZB: every rank's residues are rank 0's shifted by -1 (offsets [5,-1,5,-1]).

    F0 and B1 wait five slots per hop, so rank 0's first chunk lives almost 2p periods:
    with the second chunk, 2p half-chunk activations (p M_B) in flight, which is what it
    takes to have a runnable pass in every slot of the warm-up and the cool-down.
    """
    block = blocks.offset_block(p, (0, 1, 2, 3), (5, -1, 5, -1), (5, -1, 5, -1), p - 1)
    assert block is not None  # a uniform shift never makes two residues of a rank collide
    return block


def vmin_budget(p: int) -> int:
    """V-Min's activation budget in half-chunk units: floor((p+4)/3) M_B."""
    return 2 * ((p + 4) // 3)


def vhalf_budget(p: int) -> int:
    """V-Half's activation budget in half-chunk units: floor((p+2)/2) M_B."""
    return 2 * ((p + 2) // 2)


def _any_m(p: int, v: int, k: int) -> int:
    # Repeating a valid block is itself a valid timing for any number of micro-batches.
    return 1


@builtin(
    "v-zb", aliases=("zb-v",), fixed_chunks=2, placement="v", split_backward=True, min_micro_batches=_any_m, seq_chunks=True,
    uses_costs=True, summary=_SUMMARY + "zero bubble at peak memory p",
)
def v_zb(p: int, m: int, *, v: int = 2, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    return _build("v-zb", p, m, vzb_block(p), 2 * p, costs, seq_chunks=k)


def _slot_model(costs: Costs) -> bool:
    # Equal F, B and W, free hops, even stages: the timing model the blocks are built in; there the
    # paper's schedule is kept as built (V-ZB's is the least step of any V order at its memory).
    even = costs.stage_scale is None or len(set(costs.stage_scale)) <= 1
    return costs.f == costs.b == costs.w and costs.comm == 0 and even


def _fastest_for(block: Schedule, costs: Costs, limit: float) -> Schedule:
    """The block's order, or the greedy order (``v_greedy``) that the simulator finds faster under
    ``costs`` within the block's bound ``limit`` (M_B, with the share ``costs.w_memory`` counted until
    W, and everything W keeps within twice it, as the blocks are held); the block wins ties."""
    p, m = block.stages, block.micro_batches
    found = _greedy_best(p, m, costs, limit, simulate(block, costs).makespan)
    if found is None:
        return block
    name, ranks = found
    order = Schedule(block.name, p, m, 2, 1, block.stage_to_rank, ranks)
    params = {**block.params, "picked": name, "peak_memory": simulate(order, costs).max_peak_memory,
              "peak_memory_until_w": simulate(order, costs, kept_until_w=1.0).max_peak_memory}
    for stale in ("block", "span_idle_slots", "choice"):  # the block's, not this order's
        params.pop(stale, None)
    return Schedule(block.name, p, m, 2, 1, block.stage_to_rank, ranks, params=params)


# Cached: auto makes each candidate for its choice, then every rank the chosen one, again at a batch ramp-up.
@functools.lru_cache(maxsize=32)
def _greedy_best(p: int, m: int, costs: Costs, limit: float, to_beat: float) -> tuple[str, tuple[tuple[Action, ...], ...]] | None:
    """(policy name, order) of the fastest greedy order below ``to_beat`` within the bound, or None."""
    best = None
    for policy in VGreedyPolicy.grid():
        candidate = v_greedy_schedule(p, m, costs=costs, memory_limit=limit, policy=policy)
        if candidate is None:
            continue
        result = simulate(candidate, costs)  # memory at the share the costs name
        if (result.makespan < to_beat * (1 - _EPS) and result.max_peak_memory <= limit + _EPS
                and simulate(candidate, costs, kept_until_w=1.0).max_peak_memory <= 2 * limit + _EPS):
            best, to_beat = (candidate.name, candidate.ranks), result.makespan
    return best


@builtin(
    "v-half", fixed_chunks=2, placement="v", split_backward=True, min_micro_batches=_any_m, seq_chunks=True, uses_costs=True,
    summary=_SUMMARY + "about half of 1F1B's bubble and memory",
)
def v_half(p: int, m: int, *, v: int = 2, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    return _build("v-half", p, m, blocks.vhalf_block(p), vhalf_budget(p), costs, seq_chunks=k)


@builtin(
    "v-min", fixed_chunks=2, placement="v", split_backward=True, min_micro_batches=_any_m, seq_chunks=True, uses_costs=True,
    summary=_SUMMARY + "a third of 1F1B's memory, about 2/3 of its bubble",
)
def v_min(p: int, m: int, *, v: int = 2, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    return _build("v-min", p, m, blocks.vmin_block(p), vmin_budget(p), costs, seq_chunks=k)


def _w_memory(costs: Costs | None) -> float:
    return 0.0 if costs is None else costs.w_memory


def _build(
    name: str, p: int, m: int, block: blocks.Block, budget: int, costs: Costs | None, *, seq_chunks: int = 1,
    search_limit: float | None = None, **params: object
) -> Schedule:
    """Repeat, squeeze and fill W; the budget never goes below what the block itself holds.
    With ``seq_chunks`` k > 1 this runs on the m k units (module doc). Under ``costs`` other than the
    slot model's, a greedy order within ``search_limit`` (M_B, default the budget) replaces the block's where it
    is faster (whole sequences)."""
    _require_sizes(name, p, m)
    w_memory = _w_memory(costs)
    if seq_chunks < 1:
        raise ValueError(f"schedule {name!r} needs seq_chunks >= 1, got {seq_chunks}")
    squeezed = _squeeze(p, m, block, budget, w_memory, seq_chunks=seq_chunks)
    assert squeezed is not None  # no give_up, so never abandoned
    info = {
        "block": [list(slots) for slots in block],
        "w_memory": w_memory,
        "peak_memory": squeezed.peak(w_memory=w_memory) / 2,
        "peak_memory_until_w": squeezed.peak(w_memory=1.0) / 2,
        "span_idle_slots": max(squeezed.span_idle),
        **params,
    }
    schedule = Schedule(name, p, m, 2, seq_chunks, vshape(p), squeezed.actions(), params=info)
    if seq_chunks > 1 or costs is None or _slot_model(costs):  # k > 1: GeneratorInfo.orders_for_costs says so too
        return schedule
    return _fastest_for(schedule, costs, budget / 2 if search_limit is None else search_limit)


def _require_sizes(name: str, p: int, m: int) -> None:
    # generate() checks these too; direct calls (tests, tools) get the same message.
    if p < 2 or m < _any_m(p, 2, 1):
        raise ValueError(f"schedule {name!r} needs p >= 2 and at least {_any_m(p, 2, 1)} micro-batch, got p={p}, m={m}")


def _squeeze(
    p: int, m: int, block: blocks.Block, budget: int, w_memory: float, *, give_up: int | None = None, seq_chunks: int = 1
) -> blocks.Squeezed | None:
    blocks.check_block(block)
    k = seq_chunks
    # With k chunks a unit holds 1/k of a micro-batch: the unchunked cap, counted in units,
    # bounds the peak in M_B by the unchunked bound.
    cap = k * max(budget, blocks.order_peak(blocks.repeat(block, m)))
    orders = blocks.repeat(blocks.shift_backward(block, k), m * k)
    cap = max(cap, blocks.order_peak(orders))
    # The budget counts the share w_memory as held until W, so W passes run early enough to
    # keep it. Beyond that, the activations a W backlog holds never exceed the budget a
    # second time: F minus W stays within 2 * cap, so memory stays bounded even when a
    # runtime keeps more until W than planned.
    return blocks.squeeze(p, m * k, orders, cap=cap, w_cap=2 * cap, w_memory=w_memory, give_up=give_up, seq_chunks=k)


# ---- v-adaptive --------------------------------------------------------------------------
# The paper's search space: rank 0's residues (F0, F1, B1, B0), then offsets [k, -1, k, -1]
# for the first ranks and [1, -1, 1, -1] for the rest. A sweep of all 60 bases and all pairs
# k >= k' (p = 4..8 and 10, m = 4p) found that the rest never needs k' > 1, and that these
# three bases with k in {1, 3, 5} give up 5 idle slots in all, summed over every p and every
# budget up to 2p, against the full space, for a tenth of the blocks to try.
_BASES = ((0, 3, 4, 1), (0, 3, 2, 1), (0, 3, 4, 5))
_STEPS = (1, 3, 5)
_TIGHT = (1, -1, 1, -1)


@dataclass(frozen=True)
class _Candidate:
    level: int  # half-chunk activations the squeezed schedule may hold (its budget)
    block: blocks.Block
    label: str


@builtin(
    "v-adaptive", fixed_chunks=2, placement="v", split_backward=True, memory_limit=True, min_micro_batches=_any_m, uses_costs=True,
    summary=_SUMMARY + "lowest-bubble block within memory_limit (in M_B, default p)",
)
def v_adaptive(p: int, m: int, *, v: int = 2, k: int = 1, memory_limit: float | None = None, costs: Costs | None = None) -> Schedule:
    _require_sizes("v-adaptive", p, m)
    w_memory = _w_memory(costs)
    best = _choose(p, m, _cap(p, memory_limit), w_memory)
    if best is None:
        low = min(c.level for c in _pool(p, m)) / 2
        raise ValueError(f"v-adaptive with p={p}, m={m} needs memory_limit >= {low:g} (in M_B), got {memory_limit}")
    limit = p if memory_limit is None else memory_limit
    return _build("v-adaptive", p, m, best.block, best.level, costs, search_limit=_cap(p, memory_limit) / 2, memory_limit=limit,
                  choice=best.label)


def _cap(p: int, memory_limit: float | None) -> int:
    """The limit in half-chunk activations; anything from p M_B up (V-ZB's need) is p."""
    if memory_limit is None or memory_limit >= p:
        return 2 * p
    if not memory_limit > 0:  # also rejects NaN
        raise ValueError(f"memory_limit is in units of M_B and must be > 0, got {memory_limit}")
    return math.floor(2 * memory_limit + 1e-9)


@functools.lru_cache(maxsize=256)
def _choose(p: int, m: int, cap: int, w_memory: float) -> _Candidate | None:
    """The candidate within ``cap`` with the fewest idle slots, then the least memory.

    With ``w_memory`` 0, idle slots come from the warm-up and the cool-down only and settle
    once m reaches about 2p, so candidates are compared there (exactly at m when m <= 2p).
    With a share kept until W, a block whose peak leaves no room for pending W passes loses
    slots every period to the W passes forced in, so its idle grows with m: candidates are
    then compared at m itself. The minimum is exact: a candidate is dropped only once it
    has idled more than the best so far. Scores do not depend on ``cap``, so a larger limit
    only adds candidates and the bubble can only fall.
    """
    fitting = sorted((c for c in _pool(p, m) if c.level <= cap), key=lambda c: -c.level)
    at = min(m, 2 * p) if w_memory == 0 else m
    best: _Candidate | None = None
    best_key = ((0, 0), 0)
    for cand in fitting:  # most memory first: usually the fewest bubbles, so a tight bound early
        give_up = best_key[0][0] if best else None
        squeezed = _squeeze(p, at, cand.block, cand.level, w_memory, give_up=give_up)
        if squeezed is not None and (best is None or (squeezed.score, cand.level) < best_key):
            best, best_key = cand, (squeezed.score, cand.level)
    return best


@functools.lru_cache(maxsize=64)
def _pool(p: int, m: int) -> tuple[_Candidate, ...]:
    """The REFERENCE blocks at their budgets and the offset family at its own peak, each
    with the memory level it has at m; none above V-ZB's 2p, which would buy nothing."""
    fixed = [
        (blocks.vmin_block(p), vmin_budget(p), "v-min block"),
        (blocks.vhalf_block(p), vhalf_budget(p), "v-half block"),
        (vzb_block(p), 2 * p, "v-zb block"),
    ]
    family = [(block, 0, label) for block, label in _family(p)]
    pool = (_Candidate(max(budget, _level(block, m)), block, label) for block, budget, label in fixed + family)
    return tuple(c for c in pool if c.level <= 2 * p)


def _family(p: int) -> list[tuple[blocks.Block, str]]:
    """Distinct valid blocks of the search space, with a label naming their parameters."""
    seen: dict[blocks.Block, str] = {}
    for base in _BASES:
        for k in _STEPS:
            for n_first in range(1, p) if k > 1 else (p - 1,):
                block = blocks.offset_block(p, base, (k, -1, k, -1), _TIGHT, n_first)
                if block is not None and block not in seen:
                    seen[block] = f"base={list(base)} offsets=[{k},-1,{k},-1] on ranks 1..{n_first}"
    return list(seen.items())


def _level(block: blocks.Block, m: int) -> int:
    """The block's own peak at m. It stops growing once the first micro-batch's B0 comes
    before the last one's F0, so a few micro-batches past the longest lifespan suffice."""
    longest = max(slots[3] - slots[0] for slots in block)
    return blocks.order_peak(blocks.repeat(block, min(m, longest // blocks.PERIOD + 2)))
