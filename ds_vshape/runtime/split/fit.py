"""Keeping what split backward holds from B to W within the schedule's ``w_memory``.

A V schedule's memory bound counts a share ``w_memory`` of each unit's activation as held
from its B until its W (``pipeline.w_memory``, recorded in the schedule's params). What W
really keeps is the weight GEMMs' inputs and output gradients; a transformer block's come to
well over half of what its forward saves. So after the first B of each model stage the engine
asks ``WFit.after_backward_input``: when that unit's parked bytes exceed ``w_memory`` times
what its forward saved, some of the parked work runs at once (exact: the same W computation,
earlier) and its parameters' weight gradients are computed in B from then on, as
``pipeline.weight_grads_in_b`` would have them. The schedule's bound then holds. Units whose
forward ran before the fit park that work too; it runs at their own B, so every moved
gradient still accumulates in micro-batch order, as a fused backward's does.

What is moved: parked works sharing a storage form a group (q, k and v read one input, freed
only once all three are done). Groups are taken by bytes freed per unit of weight-gradient
work (a GEMM's multiply-adds; other parked work counts its held elements, as elementwise
work would), then picks that turn out unneeded are dropped again. Works of custom autograd
Functions (``split_graph``) stay for W: their cost is unknown, and their storages, shared with
a group, are not counted as freed. Schedules whose bound does not count ``w_memory`` (their
params have none) are left as they are, and so is ``w_memory`` 1: W then keeps all it needs,
which can be more than the forward saved (an embedding's W keeps its output gradient).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .split_backward import SplitBackwardWarning, WeightGradStore
from .split_ops import GenericWork, MatmulWork

__all__ = ["Group", "WFit", "choose", "group_works"]

_KIB = 1024
_CHAIN = 8  # a parameter-computed target reaches its parameter through a few nodes (w.t(), w.to(dtype))


@dataclass(frozen=True)
class Group:
    """Parked works that share storages: the bytes running them frees, and their weight-gradient work."""

    freed: int
    cost: float


def choose(groups: Sequence[Group], *, excess: int, budget: float = math.inf) -> list[int]:
    """Indices of the groups to run in B so that at least ``excess`` bytes are freed, at little cost.

    Greedy by bytes freed per cost, skipping a group that would take the picks' cost past
    ``budget``; then the costliest picks that are not needed are dropped. When the groups
    within the budget free less than ``excess``, all of those (the caller warns).
    """
    if excess <= 0:
        return []
    order = sorted(range(len(groups)), key=lambda i: (-_ratio(groups[i]), i))
    picked: list[int] = []
    freed, cost = 0, 0.0
    for i in order:
        if freed >= excess:
            break
        if cost + groups[i].cost > budget:
            continue
        picked.append(i)
        freed += groups[i].freed
        cost += groups[i].cost
    for i in sorted(picked, key=lambda i: (-groups[i].cost, i)):
        if freed - groups[i].freed >= excess:
            picked.remove(i)
            freed -= groups[i].freed
    return sorted(picked)


def _ratio(group: Group) -> float:
    return group.freed / group.cost if group.cost > 0 else math.inf


def group_works(works: Sequence[Any], *, skip: set[int]) -> list[tuple[list[Any], Group]]:
    """The movable works (GEMM and generic ones) grouped by shared storage, with what each group frees.

    ``skip``: storage addresses never counted (the parameters'). A storage that a work staying
    for W also holds is not freed by any group.
    """
    movable = [w for w in works if _targets(w)]
    pinned = {_key(t) for w in works if not _targets(w) for t in w.held}
    parent = list(range(len(movable)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[int, int] = {}
    for i, work in enumerate(movable):
        for t in work.held:
            parent[root(i)] = root(first.setdefault(_key(t), i))
    members: dict[int, list[Any]] = {}
    for i, work in enumerate(movable):
        members.setdefault(root(i), []).append(work)
    out = []
    for ws in members.values():
        freed = sum(n for k, n in _sizes(ws, skip).items() if k not in pinned)
        out.append((ws, Group(freed, sum(_cost(w) for w in ws))))
    return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _targets(work: Any) -> list[torch.Tensor]:
    if isinstance(work, MatmulWork):
        return [t for t in (work.weight, work.bias) if t is not None]
    if isinstance(work, GenericWork):
        return list(work.targets)
    return []


def _cost(work: Any) -> float:
    if isinstance(work, MatmulWork) and work.x is not None:
        return float(work.x.numel()) * work.grad_out.shape[-1]
    return float(sum(t.numel() for t in work.held))


def params_behind(t: torch.Tensor, store: WeightGradStore) -> list[torch.Tensor]:
    """The adopted parameters a parked work's target is (a parameter) or is computed from (``w.t()``)."""
    if t.grad_fn is None:
        return [t]
    found: list[torch.Tensor] = []
    level = [t.grad_fn]
    for _ in range(_CHAIN):
        nxt = []
        for node in level:
            param = store.trainable_param(node)
            if param is not None:
                found.append(param)
            else:
                nxt.extend(n for n, _ in node.next_functions if n is not None)
        level = nxt
    return found


def _sizes(works: Sequence[Any], skip: set[int]) -> dict[int, int]:
    """Each storage the works hold, once, with its bytes (``skip``: addresses never counted)."""
    return {_key(t): t.untyped_storage().nbytes() for w in works for t in w.held
            if t.untyped_storage().data_ptr() not in skip}


def _unique_bytes(works: Sequence[Any], skip: set[int]) -> int:
    return sum(_sizes(works, skip).values())


class WFit:
    """Per model stage: what its first split forward saved, and whether its first B was fitted."""

    def __init__(self, store: WeightGradStore) -> None:
        self._store = store
        self._saved: dict[int, int] = {}
        self._done: set[int] = set()
        # Per fitted stage: (forward's saved bytes, parked bytes after its first B, parked after the fit).
        self.fitted: dict[int, tuple[int, int, int]] = {}
        self._moved: list[torch.Tensor] = []
        self._early: set[tuple[int, int, int]] = set()

    def undo(self) -> None:
        """Give every weight gradient this fit moved back to W and fit again at each stage's next B
        (another schedule is installed: its share and its limit on the work moved may differ)."""
        self._store.compute_in_b(self._moved, in_b=False)
        self._moved.clear()
        self._early.clear()
        self._saved.clear()
        self._done.clear()
        self.fitted.clear()

    def forward_starts(self, unit: tuple[int, int, int]) -> bool:
        """A split unit's forward starts: whether the engine's meter must measure what it saves."""
        stage = unit[0]
        if stage in self._done:
            return False
        self._early.add(unit)  # forwarded before the fit: its B may park work the fit moves
        return stage not in self._saved

    def saw_forward(self, stage: int, saved_bytes: int) -> None:
        """What the stage's first split forward saved (the share's base)."""
        self._saved.setdefault(stage, saved_bytes)

    def _catch_up(self, unit: tuple[int, int, int], run_now: Callable[[Callable[[], None]], None]) -> None:
        """A unit forwarded before its stage's fit parked work the fit moved since: run it now, in
        micro-batch order with the units after it (as a fused backward would accumulate it)."""
        moved = {id(p) for p in self._moved}
        store = self._store
        works = [w for w in store.parked_of(unit)
                 if moved and _targets(w) and all(id(p) in moved for t in _targets(w) for p in params_behind(t, store))]
        if works:
            run_now(lambda: store.run_now(unit, works))

    def after_backward_input(self, unit: tuple[int, int, int], *, share: float | None,
                             run_now: Callable[[Callable[[], None]], None], rank: int,
                             max_moved: Callable[[], float] = lambda: 1.0) -> str | None:
        """Fit ``unit``'s parked work to ``share`` of its stage's forward, once per stage; the log
        line that says what moved (None when nothing did). ``run_now(f)`` runs ``f`` as a W pass.
        ``max_moved()``: the largest share of the unit's movable weight-gradient work that may go
        to B (``schedules.fit_limit``: beyond it the schedule falls behind 1F1B), asked only when
        something must move."""
        stage = unit[0]
        if unit in self._early and stage in self._done:
            self._early.discard(unit)
            self._catch_up(unit, run_now)
        if stage in self._done or stage not in self._saved:
            return None
        self._early.discard(unit)
        self._done.add(stage)
        saved = self._saved.pop(stage)
        if share is None or share >= 1 or saved <= 0:  # 1: W keeps all it needs, however much (module doc)
            return None
        return self._fit(unit, saved, share, run_now=run_now, where=f"rank {rank}, stage {stage}", max_moved=max_moved)

    def _fit(self, unit: tuple[int, int, int], saved: int, share: float, *, run_now: Callable[[Callable[[], None]], None],
             where: str, max_moved: Callable[[], float]) -> str | None:
        store, skip = self._store, self._store.param_storages
        works = store.parked_of(unit)
        kept = _unique_bytes(works, skip)
        excess = kept - int(share * saved)
        self.fitted[unit[0]] = (saved, kept, kept)
        if excess <= 0:
            return None
        groups = group_works(works, skip=skip)
        limit = max_moved()
        budget = limit * sum(g.cost for _, g in groups)
        moved = [w for i in choose([g for _, g in groups], excess=excess, budget=budget) for w in groups[i][0]]
        params = list({id(p): p for w in moved for t in _targets(w) for p in params_behind(t, store)}.values())
        run_now(lambda: store.run_now(unit, moved))
        store.compute_in_b(params)
        self._moved += params
        after = _unique_bytes(store.parked_of(unit), skip)
        self.fitted[unit[0]] = (saved, kept, after)
        if after > share * saved:
            why = ("with every GEMM's weight gradient in B" if limit >= 1 else
                   f"with as much weight-gradient work in B as the schedule takes before it falls behind 1F1B "
                   f"({limit:g} of it, simulated)")
            warnings.warn(f"ds_vshape split backward ({where}): W keeps {after / saved:.2f} of what the forward saves {why}, "
                          f"over pipeline.w_memory {share:g} that the schedule's memory bound counts, so this stage may hold "
                          f"up to {(after - share * saved) / _KIB:.0f} KiB more per unit waiting for W than planned: set "
                          f"w_memory to {math.ceil(after / saved * 100) / 100:.2f} (or 1) to have the schedule count it",
                          SplitBackwardWarning, stacklevel=3)
        if not params:
            return None
        modules = sorted({store.owner_of(p).split(" (")[0] for p in params})
        return (f"ds_vshape ({where}): split backward kept {kept / _KIB:.0f} KiB from B to W, {kept / saved:.3f} of the "
                f"{saved / _KIB:.0f} KiB the forward saved, over pipeline.w_memory {share:g}; the weight gradients of "
                f"{len(modules)} modules are computed in B from now on ({', '.join(modules[:6])}"
                f"{', ...' if len(modules) > 6 else ''}): W keeps {after / saved:.3f}. Set w_memory to 1 to defer all.")
