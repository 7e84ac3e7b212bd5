"""Split backward for the autograd nodes the routing cannot see: custom ``torch.autograd.Function``s.

``split_mode`` routes torch calls, but inside ``Function.forward`` grad is off: a Function that
takes a parameter (Megatron's tensor-parallel linear, fused kernels of apex, Liger or
Transformer Engine) reaches the graph as one node of its own. ``derived_kind`` and
``inspect_outputs`` find such nodes (the routing asks about every tensor an operation
consumes, and about every routed module's outputs) and sort them by where the gradients of
their inputs go:

* derived (every tensor input is a trainable parameter, or computed from parameters only):
  its output is parameter-like for the routing, so the GEMM consuming it takes the fast path
  and sends it nothing in B. (A tensor input that needs no gradient may be the activation, a
  first stage's input, so a Function that has one is split, not derived: a quantizer taking
  constant scales thus leaves the weight gradient of the GEMM it feeds in B, exact.) The same
  holds along the chain behind an input: a node with an input without gradient, or one of
  ds_vshape's own split nodes (a parameter met an activation there), yields an activation,
  so ``fc(data)`` on a first stage is never taken for parameter-only (W would backward through
  the GEMM node B freed). Its B then does nothing but keep the node's saved tensors; its
  backward runs when W pushes the weight gradient through it.
* split (an activation and a parameter meet in it): B runs the Function's backward with the
  deferred parameters' ``needs_input_grad`` off; W runs it again with only theirs on and adds
  what it returns to the parameters. In between only the node's saved tensors (unpacked once,
  in B: the tensors autograd kept anyway), its output gradients and the Function's own ctx
  attributes are kept; the node itself and the graph around it are freed by B as usual.
* anything else: left to autograd.

A backward that returns (or writes, into ``.grad`` or Megatron's ``main_grad``) a deferred
parameter's gradient although B did not ask for it computes both anyway (Megatron's does):
its B result is used as it is, so the node runs whole in B once, and a ``SplitBackwardWarning``
names it once. A collective (any c10d operation) that B ran inside a split node may not run
again: should W's backward try one, W fails naming the Function instead of running it twice.
Parameters with at most one dimension (norm scales, biases) are B's by design: never deferred.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node
from torch.utils._python_dispatch import TorchDispatchMode

from .split_ops import OpStore, accumulate

__all__ = ["ACT", "IN_B", "PARAM", "GraphStore", "derived_kind", "inspect_outputs"]

# IN_B: a parameter whose gradient B computes by design (the store's ``grad_in_b``: cheap, or named in
# weight_grads_in_b), or a tensor computed from such parameters only.
ACT, PARAM, IN_B = "activation", "parameter", "parameter computed in B"
_ATTR = "_ds_vshape_split"
_MAX_CHAIN = 4  # a parameter reaches a node through at most this many parameter-only nodes (w.t().to(bf16))
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


class GraphStore(OpStore, Protocol):
    """What custom-node splitting asks of the store."""

    @property
    def current(self) -> Hashable | None: ...

    def trainable_param(self, node: Node) -> torch.Tensor | None: ...

    def grad_in_b(self, t: torch.Tensor) -> bool: ...

    def kept_whole(self, name: str, params: list[torch.Tensor]) -> None: ...

    @property
    def in_module(self) -> bool: ...

    def used_outside(self) -> None: ...


@dataclass(eq=False)
class _Info:
    """What a custom node is (see the module docstring), kept on the node itself."""

    kind: str  # "plain", "derived" or "split"
    store: GraphStore | None = None
    key: Hashable = None
    in_b: bool = False  # derived: only parameters computed in B behind it
    deferred: tuple[int, ...] = ()  # split: forward-argument positions whose gradient W computes
    edges: tuple[tuple[Node, int], ...] = ()  # split: their gradient edges
    stash: _Replay | None = None  # derived: what its backward needs, kept from B to W


_PLAIN = _Info("plain")


class _Replay:
    """What a Function's backward gets as ``ctx`` when it runs outside its node: the Function's
    own attributes, its saved tensors (unpacked once, in B) and the ``needs_input_grad`` asked for."""

    def __init__(self, attrs: dict[str, Any], saved: tuple[torch.Tensor, ...], needs: tuple[bool, ...]) -> None:
        self.__dict__.update(attrs)
        self.saved_tensors = saved
        self.needs_input_grad = needs

    def asking(self, needs: tuple[bool, ...]) -> _Replay:
        return _Replay({k: v for k, v in vars(self).items() if k not in ("saved_tensors", "needs_input_grad")},
                       self.saved_tensors, needs)


# ---- finding and sorting the nodes -----------------------------------------------------------
def derived_kind(store: GraphStore, t: torch.Tensor) -> str | None:
    """PARAM or IN_B when ``t`` comes out of a custom Function fed by parameters only, else None."""
    fn = t.grad_fn
    if not _is_custom(fn):
        return None
    info = _classify(store, fn)
    return (IN_B if info.in_b else PARAM) if info.kind == "derived" else None


def inspect_outputs(store: GraphStore, out: Any) -> None:
    """Sort the custom nodes behind a module's outputs (nothing else may consume them in the unit)."""
    with torch._C.DisableTorchFunction():  # tensor attributes would enter the routing mode, once per output
        for t in _tensors_in(out):
            if t.requires_grad and _is_custom(t.grad_fn):
                _classify(store, t.grad_fn)


def _tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output: itself, or inside tuples, lists and dicts (model outputs)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors_in(v)]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors_in(v)]
    return []


def _is_custom(fn: Node | None) -> bool:
    return isinstance(fn, BackwardCFunction) and not _is_internal(fn)


def _is_internal(fn: Node) -> bool:
    """One of ds_vshape's own Functions (``split_ops``): split by itself, never taken over."""
    return isinstance(fn, BackwardCFunction) and getattr(fn._forward_cls, "_ds_vshape_internal", False)


def _classify(store: GraphStore, fn: BackwardCFunction) -> _Info:
    info = getattr(fn, _ATTR, None)
    if info is not None:
        return info
    if store.current is None:
        return _PLAIN  # not in a unit's forward: autograd's as it is (and not remembered)
    setattr(fn, _ATTR, _PLAIN)  # while its inputs are looked at
    needs = fn.needs_input_grad
    edges = fn.next_functions
    live = [(n, nr) for n, nr in edges if n is not None]
    positions = [i for i, need in enumerate(needs) if need]
    # A live edge per input that needs a gradient, in order; anything else is left to autograd.
    if len(live) == len(positions) and not getattr(fn._forward_cls, "boxed_grads_call", False):
        kinds = [_edge_kind(store, n, 0) for n, _ in live]
        # A tensor input without gradient may be the activation (a first stage's input): not derived then.
        info = _decide(store, fn, positions, live, kinds, constants=len(live) < len(edges))
        setattr(fn, _ATTR, info)
    return getattr(fn, _ATTR)


def _decide(store: GraphStore, fn: BackwardCFunction, positions: list[int], live: list[tuple[Node, int]],
            kinds: list[str], *, constants: bool) -> _Info:
    deferred = [j for j, k in enumerate(kinds) if k == PARAM]
    if deferred and not store.in_module:
        store.used_outside()  # a Function taking a deferred parameter outside the modules owning one
    if ACT not in kinds and kinds and not constants:
        if deferred:
            fn.materialize_grads = False  # B must see None where W will bring the gradient
            _take_over(fn)
        return _Info("derived", store, store.current, in_b=not deferred)
    if not deferred:
        return _PLAIN  # activations and parameters computed in B: autograd does it all in B, by design
    _take_over(fn)
    return _Info("split", store, store.current, deferred=tuple(positions[j] for j in deferred),
                 edges=tuple(live[j] for j in deferred))


def _edge_kind(store: GraphStore, node: Node, depth: int) -> str:
    """ACT, PARAM or IN_B: what reaches ``node``'s inputs (a parameter only through short chains)."""
    param = store.trainable_param(node)
    if param is not None:
        return IN_B if store.grad_in_b(param) else PARAM
    if isinstance(node, torch._C._functions.AccumulateGrad):
        return ACT  # a leaf that is not a deferred parameter: a stage input, say
    if _is_custom(node):
        info = _classify(store, node)
        return (IN_B if info.in_b else PARAM) if info.kind == "derived" else ACT
    if depth >= _MAX_CHAIN or _is_internal(node):
        # ds_vshape's own nodes exist only where the routing saw a parameter meet something else:
        # their output is an activation, and B frees them (W must never backward through them).
        return ACT
    edges = node.next_functions
    if any(n is None for n, _ in edges):
        # A float input without gradient: a first stage's data or a constant, an activation to the
        # routing. Looking past it would make the node parameter-only (B would free it, W re-enter it).
        return ACT
    kinds = [_edge_kind(store, n, depth + 1) for n, _ in edges]
    if not kinds or ACT in kinds:
        return ACT
    return IN_B if all(k == IN_B for k in kinds) else PARAM


_SUBCLASSES: dict[type, type] = {}


def _take_over(fn: BackwardCFunction) -> None:
    """Route the node's backward through ``_apply``: its class becomes a same-named subclass.

    A subclass rather than an attribute: the node keeps no reference to itself (no cycle
    holding its saved tensors until the garbage collector runs).
    """
    cls = type(fn)
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"apply": _apply, "__qualname__": cls.__qualname__, "__module__": cls.__module__})
        _SUBCLASSES[cls] = sub
    fn.__class__ = sub


# ---- the passes ---------------------------------------------------------------------------------
def _apply(self: BackwardCFunction, *grads: torch.Tensor | None) -> Any:
    """The node's backward, as the autograd engine calls it."""
    info: _Info = getattr(self, _ATTR)
    store = info.store
    assert store is not None
    if info.kind == "derived":
        return _derived_backward(self, info, grads)
    if store.is_deferring(info.key):
        return _split_b(self, info, grads)
    return BackwardCFunction.apply(self, *grads)


def _derived_backward(self: BackwardCFunction, info: _Info, grads: tuple[torch.Tensor | None, ...]) -> Any:
    store = info.store
    assert store is not None
    if store.is_deferring(info.key):
        if info.stash is None:  # consumers parked work that comes back through here in W: keep what it needs
            info.stash = _Replay(_attrs(self), self.saved_tensors, self.needs_input_grad)
            store.park(info.key, _Release(info, tuple(_tensors(info.stash.saved_tensors))))
        if all(g is None for g in grads):
            return (None,) * len(self.needs_input_grad)
    full = tuple(g if g is not None else _zeros(self, i) for i, g in enumerate(grads))  # it may expect zeros
    if info.stash is not None:
        return _user_backward(self)(info.stash.asking(self.needs_input_grad), *full)
    return BackwardCFunction.apply(self, *full)


def _user_backward(fn: BackwardCFunction) -> Callable[..., Any]:
    """The Function's own backward (its ``vjp`` where it defines one), as autograd calls it.

    Looked up here: torch 2.12 added ``BackwardCFunction._get_user_fn`` for it, older ones have none.
    """
    cls = fn._forward_cls
    return cls.vjp if cls.vjp is not torch.autograd.Function.vjp else cls.backward


def _split_b(self: BackwardCFunction, info: _Info, grads: tuple[torch.Tensor | None, ...]) -> Any:
    store = info.store
    assert store is not None
    user = _user_backward(self)
    needs = self.needs_input_grad
    ctx = _Replay(_attrs(self), self.saved_tensors, tuple(n and i not in info.deferred for i, n in enumerate(needs)))
    params = [p for node, _ in info.edges for p in _params_behind(store, node, 0)]
    before = _grad_versions(params)
    kept = _versions(grads)
    with _Collectives() as seen:
        raw = user(ctx, *grads)
    result = raw if isinstance(raw, tuple) else (raw,)
    if any(i < len(result) and result[i] is not None for i in info.deferred) or _grad_versions(params) != before:
        # It computed the parameters' gradients anyway: keep them (whole in B), never run it again.
        store.kept_whole(_name(self), params)
        return raw
    work = _SplitWork(user, ctx.asking(tuple(i in info.deferred for i in range(len(needs)))), tuple(grads), info,
                      _name(self) if seen.count else None, kept)
    work.check(when="B")
    store.park(info.key, work)
    return raw


@dataclass(eq=False)
class _SplitWork:
    """W of a split node: its backward again, asking for the deferred parameters only."""

    user: Callable[..., Any]
    ctx: _Replay
    grads: tuple[torch.Tensor | None, ...]
    info: _Info
    refuse_collectives: str | None  # the Function's name when its B ran a collective
    grad_versions: list[int]  # of ``grads`` before B's call
    held: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        self.held = tuple(_tensors(self.ctx.saved_tensors)) + tuple(_tensors(self.grads))
        self.saved_versions = _versions(self.ctx.saved_tensors)

    def check(self, *, when: str) -> None:
        """W reuses B's output gradients and the saved tensors: neither may have changed in place."""
        if _versions(self.grads) != self.grad_versions or _versions(self.ctx.saved_tensors) != self.saved_versions:
            raise RuntimeError(f"ds_vshape split backward: {_name_of(self.user)}'s output gradients or saved tensors were "
                               f"modified in place ({when}), but W needs them as B got them: make its backward leave "
                               "its output gradient unmodified, or pick a schedule without split backward for this model")

    def run(self) -> None:
        store = self.info.store
        assert store is not None
        self.check(when="between B and W")
        with torch.no_grad(), _Collectives(refuse=self.refuse_collectives):
            raw = self.user(self.ctx, *self.grads)
        result = raw if isinstance(raw, tuple) else (raw,)
        for i, (node, nr) in zip(self.info.deferred, self.info.edges):
            grad = result[i] if i < len(result) else None
            if grad is None:
                continue
            param = store.trainable_param(node)
            if param is not None:
                accumulate([param], [grad])
            else:  # a parameter-only chain (w.t(), a derived Function): retained, it may feed more nodes
                torch.autograd.backward([GradientEdge(node, nr)], [grad], retain_graph=True)


@dataclass(eq=False)
class _Release:
    """Ends a derived node's stash when its unit's W is done (parked after its consumers' work)."""

    info: _Info
    held: tuple[torch.Tensor, ...]

    def run(self) -> None:
        self.info.stash = None


class _Collectives(TorchDispatchMode):
    """Counts the c10d operations run inside; with ``refuse`` (a Function's name) raises on the first."""

    def __init__(self, *, refuse: str | None = None) -> None:
        super().__init__()
        self.count = 0
        self.refuse = refuse

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        if func.namespace in _COLLECTIVES:
            if self.refuse is not None:
                raise RuntimeError(
                    f"ds_vshape split backward: {self.refuse}'s backward ran a collective ({func}) in B and tries one again "
                    "in W, asked for its parameters' gradients only; a collective must not run twice. Make its backward "
                    "run the collective only for the gradient that needs it (ctx.needs_input_grad), or pick a schedule "
                    "without split backward for this model.")
            self.count += 1
        return func(*args, **(kwargs or {}))


def _attrs(fn: BackwardCFunction) -> dict[str, Any]:
    return {k: v for k, v in vars(fn).items() if k != _ATTR}


def _zeros(fn: BackwardCFunction, i: int) -> torch.Tensor:
    meta = fn._input_metadata[i]
    return torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)


def _tensors(values: Any) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor)]


def _params_behind(store: GraphStore, node: Node, depth: int) -> list[torch.Tensor]:
    """The parameters a parameter edge leads to: the parameter itself, or those behind its chain."""
    param = store.trainable_param(node)
    if param is not None:
        return [param]
    if depth >= _MAX_CHAIN or isinstance(node, torch._C._functions.AccumulateGrad):
        return []
    return [p for n, _ in node.next_functions if n is not None for p in _params_behind(store, n, depth + 1)]


def _grad_versions(params: list[torch.Tensor]) -> list[Any]:
    """Where a backward could have put a parameter's gradient itself: ``.grad`` and ``main_grad``."""
    return [None if g is None else (id(g), g._version) for p in params for g in (p.grad, getattr(p, "main_grad", None))]


def _versions(values: Any) -> list[int]:
    return [t._version for t in _tensors(values)]


def _name(fn: BackwardCFunction) -> str:
    cls = fn._forward_cls
    return f"{cls.__module__}.{cls.__qualname__}"


def _name_of(user: Callable[..., Any]) -> str:
    return getattr(user, "__qualname__", repr(user)).removesuffix(".backward")
