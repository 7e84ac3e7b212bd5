"""Cutting layers into model stages from measured per-layer costs (``partition_method: profile``).

Pure: given each layer's cost (time of F+B+W, activation bytes kept per micro-batch,
parameter bytes) and a placement (which rank owns which stage), find the cut whose busiest
rank is least busy. A rank's time is the sum over its stages; its memory is its parameters
plus, per stage, the activation of the micro-batches that stage holds at the rank's peak
under the schedule (``stage_inflight``). That is how a V placement puts the embedding, the
LM head and the logits on rank 0 and still balances it: the measured costs include them.

The objective is lexicographic: least busiest-rank time; among cuts within ``time_slack``
of it, least busiest-rank memory; among those, least time again. Measured times are noisy by
a few percent, so trading a difference below the noise for memory is free.

Exact for linear placement (a DP over ranks and one boundary) and V placement (a DP over
ranks from the outside in and two boundaries: rank r's stages r and 2p-1-r close in on the
middle of the layer list). Any other placement (looped, custom), and a V of more than
``_MAX_V_DP_LAYERS`` layers, is searched branch and bound from a local search's cut: exact
when the search ends within ``_NODE_BUDGET`` nodes, else the best cut found by then (the
budget counts nodes, not seconds, so every run gives the same cut).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .ir import Kind, Schedule
from .placement import linear, vshape

__all__ = ["LayerCost", "Cut", "boundary_moves", "cut_layers", "pool_alike", "rank_loads", "slack_limit", "stage_inflight"]

_INF = float("inf")
# The V DP is O(p L^4 / 12) element operations; beyond this many layers it would take
# seconds, so the cut falls back to the local search (which starts from a good cut).
_MAX_V_DP_LAYERS = 96
_NODE_BUDGET = 60_000


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs for one micro-batch: ``time`` of F+B+W in seconds (the last layer
    includes the loss), ``activation_bytes`` kept for backward, ``param_bytes`` of its weights."""

    time: float
    activation_bytes: float = 0.0
    param_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("time", "activation_bytes", "param_bytes"):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"LayerCost.{name} must be a number >= 0, got {value}")


@dataclass(frozen=True)
class Cut:
    """Stage boundaries (``parts[s]``..``parts[s+1]`` are stage s's layers) and what each rank gets."""

    parts: tuple[int, ...]
    rank_time: tuple[float, ...]
    rank_memory: tuple[float, ...]

    @property
    def busiest_time(self) -> float:
        return max(self.rank_time)

    @property
    def busiest_memory(self) -> float:
        return max(self.rank_memory)


def pool_alike(costs: Sequence[LayerCost], kinds: Sequence[str | None]) -> tuple[LayerCost, ...]:
    """Layers of one kind (``kinds[i]``; None: alike to no other) take the median time of their kind.

    Identical blocks cost the same; their measured times differ only by noise, and a cut that
    follows that noise can put the blocks where they hold far more memory (the slack that trades
    time for memory is smaller than the noise). Pooling makes alike layers exchangeable, so
    the memory criterion decides between them.
    """
    if len(kinds) != len(costs):
        raise ValueError(f"pool_alike: {len(costs)} costs but {len(kinds)} kinds")
    groups: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        if kind is not None:
            groups.setdefault(kind, []).append(i)
    out = list(costs)
    for members in groups.values():
        if len(members) > 1:
            times = sorted(costs[i].time for i in members)
            mid = len(times) // 2
            median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
            for i in members:
                out[i] = LayerCost(median, costs[i].activation_bytes, costs[i].param_bytes)
    return tuple(out)


def stage_inflight(schedule: Schedule, *, kept_until_w: float = 0.0) -> tuple[float, ...]:
    """Per model stage: micro-batches of that stage's activation held at its rank's peak.

    Each rank's order is walked as the simulator counts memory (a unit of k sequence chunks
    holds 1/k; B frees all but ``kept_until_w``, W the rest); at the moment the rank's total
    is highest, each of its stages' counts is taken.
    """
    counts = [0.0] * schedule.num_model_stages
    share = 1.0 / schedule.seq_chunks
    for actions in schedule.ranks:
        live: dict[int, float] = {}
        best_total, best = 0.0, dict(live)
        for a in actions:
            delta = {Kind.F: share, Kind.B: -share * (1 - kept_until_w), Kind.W: -share * kept_until_w}.get(a.kind, -share)
            live[a.stage] = live.get(a.stage, 0.0) + delta
            total = sum(live.values())
            if total > best_total:
                best_total, best = total, dict(live)
        for stage, count in best.items():
            counts[stage] = count
    return tuple(counts)


def rank_loads(parts: Sequence[int], costs: Sequence[LayerCost], stage_to_rank: Sequence[int], *,
               inflight: Sequence[float] | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(time, memory) of every rank for a cut; memory counts ``inflight[s]`` micro-batches of stage s."""
    p = max(stage_to_rank) + 1
    held = inflight if inflight is not None else (1.0,) * len(stage_to_rank)
    times, memory = [0.0] * p, [0.0] * p
    for s, rank in enumerate(stage_to_rank):
        layers = costs[parts[s]:parts[s + 1]]
        times[rank] += sum(c.time for c in layers)
        memory[rank] += sum(c.param_bytes + held[s] * c.activation_bytes for c in layers)
    return tuple(times), tuple(memory)


def slack_limit(least: float, slack: float) -> float:
    """The most a value may be and still count as within ``slack`` (a share) of ``least``."""
    return least * (1 + slack) + 1e-12 * max(1.0, least)


def boundary_moves(parts: Sequence[int]) -> list[tuple[int, ...]]:
    """The cuts one move from ``parts``: one boundary anywhere between its neighbours; or a run of
    boundaries k..k2 shifted by one layer together (a layer handed from stage k2 to stage k-1 across
    the stages between, which single moves cannot do without first making some rank busier)."""
    parts, stages, moves = list(parts), len(parts) - 1, []
    for k in range(1, stages):
        moves += [tuple(parts[:k] + [pos] + parts[k + 1:]) for pos in range(parts[k - 1] + 1, parts[k + 1]) if pos != parts[k]]
    for k in range(1, stages):
        for k2 in range(k + 1, stages):
            for delta in (-1, 1):
                trial = parts[:k] + [b + delta for b in parts[k:k2 + 1]] + parts[k2 + 1:]
                if all(a < b for a, b in zip(trial, trial[1:])):
                    moves.append(tuple(trial))
    return moves


def cut_layers(costs: Sequence[LayerCost], stage_to_rank: Sequence[int], *, inflight: Sequence[float] | None = None,
               time_slack: float = 0.02) -> Cut:
    """The cut of ``costs`` into ``len(stage_to_rank)`` non-empty stages that minimises the busiest
    rank: its time, then (within ``time_slack`` of the least time) its memory, then its time."""
    placement = tuple(stage_to_rank)
    stages = len(placement)
    if stages < 1 or sorted(set(placement)) != list(range(max(placement) + 1)):
        raise ValueError(f"stage_to_rank {list(placement)} must name every rank 0..p-1 at least once")
    if len(costs) < stages:
        raise ValueError(f"{len(costs)} layers cannot be cut into {stages} non-empty stages; use fewer stages or split the model finer")
    if inflight is not None and len(inflight) != stages:
        raise ValueError(f"inflight has {len(inflight)} entries, the placement has {stages} stages")
    if not time_slack >= 0:
        raise ValueError(f"time_slack is a share of the least busiest-rank time and must be >= 0, got {time_slack}")
    p = max(placement) + 1
    held = tuple(inflight) if inflight is not None else (1.0,) * stages
    if placement == linear(p):
        solve: Callable[..., tuple[int, ...] | None] = _LinearDP(costs, held).solve
    elif p >= 2 and placement == vshape(p) and len(costs) <= _MAX_V_DP_LAYERS:
        solve = _VDP(costs, held).solve
    else:
        solve = _BranchAndBound(costs, placement, held).solve
    parts = _lexicographic(solve, costs, placement, held, time_slack)
    times, memory = rank_loads(parts, costs, placement, inflight=held)
    return Cut(parts, times, memory)


def _lexicographic(solve: Callable[..., tuple[int, ...] | None], costs: Sequence[LayerCost], placement: tuple[int, ...],
                   held: tuple[float, ...], slack: float) -> tuple[int, ...]:
    """Three solves: least time; least memory within the slack; least time at that memory."""
    def busiest(parts: tuple[int, ...] | None) -> tuple[float, float]:
        assert parts is not None, "a solve without limits always finds a cut"
        times, memory = rank_loads(parts, costs, placement, inflight=held)
        return max(times), max(memory)

    first = solve("time")
    fastest, _ = busiest(first)
    time_limit = slack_limit(fastest, slack)
    second = solve("memory", time_limit=time_limit, start=first)  # the first cut meets this limit
    _, leanest = busiest(second)
    memory_limit = leanest * (1 + 1e-9) + 1e-9
    parts = solve("time", time_limit=time_limit, memory_limit=memory_limit, start=second)
    assert parts is not None, "the memory solve's own cut meets both limits"
    return parts


class _Prefix:
    """Prefix sums: time, activation and parameter bytes of layers [i, j) in O(1)."""

    def __init__(self, costs: Sequence[LayerCost]) -> None:
        self.n = len(costs)
        self.t = np.concatenate(([0.0], np.cumsum([c.time for c in costs])))
        self.a = np.concatenate(([0.0], np.cumsum([c.activation_bytes for c in costs])))
        self.w = np.concatenate(([0.0], np.cumsum([c.param_bytes for c in costs])))

    def matrices(self, held: float) -> tuple[np.ndarray, np.ndarray]:
        """time[i, j] and memory[i, j] of the segment [i, j) for a stage holding ``held``
        micro-batches; inf where j <= i (empty or reversed)."""
        valid = np.arange(self.n + 1)[None, :] > np.arange(self.n + 1)[:, None]
        time = np.where(valid, self.t[None, :] - self.t[:, None], _INF)
        memory = np.where(valid, (self.w[None, :] - self.w[:, None]) + held * (self.a[None, :] - self.a[:, None]), _INF)
        return time, memory


def _limited(objective: str, time: np.ndarray, memory: np.ndarray, time_limit: float, memory_limit: float) -> np.ndarray:
    value = time if objective == "time" else memory
    return np.where((time <= time_limit) & (memory <= memory_limit), value, _INF)


class _LinearDP:
    """One stage per rank: f_r(i) = min over i' of max(rank r's [i, i'), f_{r+1}(i'))."""

    def __init__(self, costs: Sequence[LayerCost], held: tuple[float, ...]) -> None:
        self.prefix = _Prefix(costs)
        self.held = held

    def solve(self, objective: str, *, time_limit: float = _INF, memory_limit: float = _INF,
              start: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
        n, p = self.prefix.n, len(self.held)
        value = np.full(n + 1, _INF)
        value[n] = 0.0  # no layers left after the last rank
        choice: list[np.ndarray] = [np.zeros(0, dtype=int)] * p
        for r in reversed(range(p)):
            seg = _limited(objective, *self.prefix.matrices(self.held[r]), time_limit, memory_limit)
            total = np.maximum(seg, value[None, :])  # [i, i'] -> worst of this rank and the rest
            choice[r] = np.argmin(total, axis=1)
            value = total[np.arange(n + 1), choice[r]]
        if not np.isfinite(value[0]):
            return None
        parts, i = [0], 0
        for r in range(p):
            i = int(choice[r][i])
            parts.append(i)
        return tuple(parts)


class _VDP:
    """V placement: rank r holds stage r = [i, i') and stage 2p-1-r = [j', j) of the layers
    [i, j) the outer ranks left; f_r(i, j) = min max(rank r, f_{r+1}(i', j')). The last rank
    holds the middle [i, j), cut where its memory is least (its time does not depend on it)."""

    def __init__(self, costs: Sequence[LayerCost], held: tuple[float, ...]) -> None:
        self.prefix = _Prefix(costs)
        self.held = held
        self.p = len(held) // 2

    def solve(self, objective: str, *, time_limit: float = _INF, memory_limit: float = _INF,
              start: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
        n, p = self.prefix.n, self.p
        value, turn = self._middle(objective, time_limit, memory_limit)
        choices: list[dict[tuple[int, int], tuple[int, int]]] = [{} for _ in range(p - 1)]
        for r in reversed(range(p - 1)):
            value = self._rank(r, value, choices[r], objective, time_limit, memory_limit, outer=(r == 0))
        if not np.isfinite(value[0, n]):
            return None
        left, right, i, j = [0], [n], 0, n
        for r in range(p - 1):
            i, j = choices[r][(i, j)]
            left.append(i)
            right.append(j)
        return tuple(left + [int(turn[i, j])] + right[::-1])

    def _middle(self, objective: str, time_limit: float, memory_limit: float) -> tuple[np.ndarray, np.ndarray]:
        """The last rank on [i, j): best value and where its two stages meet (the V's turn)."""
        n, p = self.prefix.n, self.p
        down_t, down_m = self.prefix.matrices(self.held[p - 1])
        up_t, up_m = self.prefix.matrices(self.held[p])
        value, turn = np.full((n + 1, n + 1), _INF), np.zeros((n + 1, n + 1), dtype=int)
        for i in range(n - 1):
            js = np.arange(i + 2, n + 1)
            # Memory is linear in the turn's prefix sum, so its least is at an end: i+1 or j-1.
            for c in (np.full_like(js, i + 1), js - 1):
                t = down_t[i, c] + up_t[c, js]
                cand = _limited(objective, t, down_m[i, c] + up_m[c, js], time_limit, memory_limit)
                better = cand < value[i, js]
                value[i, js] = np.where(better, cand, value[i, js])
                turn[i, js] = np.where(better, c, turn[i, js])
        return value, turn

    def _rank(self, r: int, inner: np.ndarray, choice: dict[tuple[int, int], tuple[int, int]], objective: str,
              time_limit: float, memory_limit: float, *, outer: bool) -> np.ndarray:
        n, p = self.prefix.n, self.p
        down_t, down_m = self.prefix.matrices(self.held[r])
        up_t, up_m = self.prefix.matrices(self.held[2 * p - 1 - r])
        value = np.full((n + 1, n + 1), _INF)
        pairs = [(0, n)] if outer else [(i, j) for i in range(n) for j in range(i + 2 * (p - r), n + 1)]
        for i, j in pairs:
            mids = np.arange(i + 1, j)  # i' (end of stage r) and j' (start of stage 2p-1-r)
            t = down_t[i, mids][:, None] + up_t[mids, j][None, :]
            m = down_m[i, mids][:, None] + up_m[mids, j][None, :]
            own = _limited(objective, t, m, time_limit, memory_limit)
            total = np.maximum(own, inner[np.ix_(mids, mids)])  # inner is inf unless i' < j' leaves room
            flat = int(np.argmin(total))
            a, b = divmod(flat, len(mids))
            value[i, j] = total[a, b]
            choice[(i, j)] = (int(mids[a]), int(mids[b]))
        return value


class _LocalSearch:
    """Any placement: start from the least busiest-stage cut, then move single boundaries
    while the busiest rank (and then the sum of squares, to leave plateaus) improves."""

    def __init__(self, costs: Sequence[LayerCost], placement: tuple[int, ...], held: tuple[float, ...]) -> None:
        self.costs, self.placement, self.held = costs, placement, held

    def solve(self, objective: str, *, time_limit: float = _INF, memory_limit: float = _INF,
              start: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
        """``start``: a cut that meets the limits (the previous solve's), so the search stays within them."""
        stages = len(self.placement)
        start = start or _LinearDP(self.costs, (1.0,) * stages).solve("time")
        assert start is not None
        parts, key = list(start), self._key(start, objective, time_limit, memory_limit)
        improved = True
        while improved:
            improved = False
            for trial in boundary_moves(parts):
                trial_key = self._key(trial, objective, time_limit, memory_limit)
                if trial_key < key:
                    parts, key, improved = list(trial), trial_key, True
        return tuple(parts) if key[0] == 0 else None

    def _key(self, parts: tuple[int, ...], objective: str, time_limit: float, memory_limit: float) -> tuple[float, ...]:
        times, memory = rank_loads(parts, self.costs, self.placement, inflight=self.held)
        # Over-limit amount first, so the search walks into the limits before it optimises.
        excess = max(0.0, max(times) - time_limit) / max(time_limit, 1e-30) + max(0.0, max(memory) - memory_limit) / max(memory_limit, 1e-30)
        values = times if objective == "time" else memory
        return (excess, max(values), sum(v * v for v in values))


class _BranchAndBound:
    """Stage by stage, every end of the stage, pruned by the best cut so far (the local
    search's to begin with): loads only grow, so a rank past the bound or a limit ends the
    branch, and the layers left must fit below the bound on average."""

    def __init__(self, costs: Sequence[LayerCost], placement: tuple[int, ...], held: tuple[float, ...]) -> None:
        self.search = _LocalSearch(costs, placement, held)
        self.prefix = _Prefix(costs)
        self.placement, self.held = placement, held
        self.p = max(placement) + 1

    def solve(self, objective: str, *, time_limit: float = _INF, memory_limit: float = _INF,
              start: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
        found = self.search.solve(objective, time_limit=time_limit, memory_limit=memory_limit, start=start)
        if found is None:
            return None
        times, memory = rank_loads(found, self.search.costs, self.placement, inflight=self.held)
        self.best, self.best_value = list(found), max(times if objective == "time" else memory)
        self.limits, self.objective, self.nodes = (time_limit, memory_limit), objective, 0
        self._branch(0, [0], [0.0] * self.p, [0.0] * self.p)
        return tuple(self.best)

    def _branch(self, stage: int, parts: list[int], times: list[float], memory: list[float]) -> None:
        n, stages, pre = self.prefix.n, len(self.placement), self.prefix
        self.nodes += 1
        if self.nodes > _NODE_BUDGET:
            return
        start, rank = parts[-1], self.placement[stage]
        last = stage == stages - 1
        for end in ([n] if last else range(start + 1, n - (stages - stage - 1) + 1)):
            t = times[rank] + pre.t[end] - pre.t[start]
            m = memory[rank] + pre.w[end] - pre.w[start] + self.held[stage] * (pre.a[end] - pre.a[start])
            own = t if self.objective == "time" else m
            if t > self.limits[0] or m > self.limits[1] or own >= self.best_value:
                break  # a longer stage only adds
            new_times, new_memory = times.copy(), memory.copy()
            new_times[rank], new_memory[rank] = t, m
            if last:
                self.best, self.best_value = parts + [n], max(new_times if self.objective == "time" else new_memory)
            elif self._may_improve(end, new_times, new_memory):
                self._branch(stage + 1, parts + [end], new_times, new_memory)

    def _may_improve(self, end: int, times: list[float], memory: list[float]) -> bool:
        # Whatever the cut of the rest, the p ranks share its time (and at least its weights).
        n, pre = self.prefix.n, self.prefix
        if self.objective == "time":
            return (sum(times) + pre.t[n] - pre.t[end]) / self.p < self.best_value
        return (sum(memory) + pre.w[n] - pre.w[end]) / self.p < self.best_value
