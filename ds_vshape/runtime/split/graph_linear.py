"""``nn.Linear`` split on autograd's own graph: no Python autograd node and no routing in its forward.

The routing (``split_mode``) sends a GEMM through ``split_ops._SplitMatmul``, a Python
``autograd.Function``: a forward under a ``TorchFunctionMode`` and a Python node per GEMM,
host time that every pass a schedule adds pays again. For the common module, a plain
``nn.Linear``, the split needs neither:

* F runs ``F.linear`` on the weight detached, so autograd's native GEMM node gets no edge
  to the weight: it computes the input's gradient (and the bias's, when B computes it)
  and never the weight's. A hook on the GEMM's output (``GemmCapture``) sees its gradient in B.
* What W needs of the forward, the GEMM's input, is kept as autograd would keep it: handed
  to the saved-tensor hooks active at the time (the activation meter, activation offload,
  a non-reentrant checkpoint), unpacked when B reaches the node.
* B's hook hands the input and the output gradient to the store, which parks them as the
  same ``MatmulWork`` the routed path parks (when B ends, in the order B reached them), so W,
  the ``w_memory`` fit and the offload of W's kept tensors see no difference.

A call that does not fit this shape takes the routed path as before: the first forward of a
scope (routed whole, to find parameters used outside their modules), a weight computed in B
(cheap, named by ``weight_grads_in_b``, moved there by the fit), an input that is itself
computed from parameters or does not need a gradient, a weight ZeRO-3 partitions (its
gathered data must not outlive the forward in a saved view). Only ``nn.Linear`` itself is
taken over (``take_over``): a subclass may have a forward of its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from enum import IntEnum
from functools import partial
from typing import Any, Callable, Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import BackwardCFunction

from .split_mode import RoutingStore, routing
from .split_ops import MatmulWork

__all__ = ["DERIVED", "GRAPH", "GRAPH_BIAS", "PLAIN", "ROUTED", "BoundStore", "GemmCapture", "GraphLinearStore", "Plan", "SplitLinear",
           "any_autocast", "take_over"]

S = TypeVar("S")  # the store a module taken over by class reports to


class Plan(IntEnum):
    """What a ``SplitLinear`` call runs as: the store's ``linear_plan`` (the common call checked inline)."""

    PLAIN = 0  # no split unit's forward runs, or B computes every gradient the call has by design
    GRAPH = 1  # split on autograd's graph
    GRAPH_BIAS = 2  # split on the graph, with the bias's gradient in W as well (cheap_in_b off)
    ROUTED = 3  # the routing's GEMM path (split_ops._SplitMatmul)


PLAIN, GRAPH, GRAPH_BIAS, ROUTED = Plan.PLAIN, Plan.GRAPH, Plan.GRAPH_BIAS, Plan.ROUTED


# The mark a parameter-computed tensor carries (an attribute on the tensor itself: looked up on every
# operation of a routed forward, where a weak dictionary's lookup cost a tenth of the forward).
DERIVED = "_ds_vshape_derived"
# Autocast on any device sends a linear to the routed path: one C call, where asking about the
# input's device builds a device object on every call of every split forward.
any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))
_grad_enabled = torch.is_grad_enabled


class GraphLinearStore(RoutingStore, Protocol):
    """What the graph split asks of the store, besides the routing's questions."""

    graph_key: Hashable | None  # the running unit, where its linear layers may split on the graph

    @property
    def in_b_ids(self) -> set[int]: ...

    def linear_plan(self, x: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> Plan: ...

    def enter_module(self, delta: int) -> None: ...

    def capture(self, capture: GemmCapture, x: torch.Tensor, grad: torch.Tensor) -> None: ...

    @property
    def asks_inputs_only(self) -> bool: ...

    def owner_of(self, param: torch.Tensor) -> str: ...


class BoundStore(Generic[S]):
    """The store a module taken over by class (``SplitLinear``, ``module_hooks.RoutedStage``) reports to:
    a deep copy of the module shares it (a copy is re-bound when split backward is enabled on it with a
    store of its own), rather than copying parked work."""

    __slots__ = ("store",)

    def __init__(self, store: S) -> None:
        self.store = store

    def __deepcopy__(self, memo: dict[int, Any]) -> BoundStore[S]:
        return self


class SplitLinear(nn.Linear):
    """An ``nn.Linear`` whose forward splits its backward on the graph when a split unit runs it."""

    _ds_vshape_bound: BoundStore[GraphLinearStore]

    @property
    def _ds_vshape_store(self) -> GraphLinearStore:
        return self._ds_vshape_bound.store

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        store = self._ds_vshape_bound.store
        weight, bias = self.weight, self.bias  # once: each read goes through nn.Module.__getattr__
        key = store.graph_key
        # The common call, checked here: every condition of ``linear_plan``'s GRAPH holds (its call alone is a
        # measurable share of a host-bound forward). Anything else, a custom Function's output included, asks it.
        if (key is not None and _grad_enabled() and weight.requires_grad and type(input) is torch.Tensor
                and input.requires_grad and input.dim() >= 2 and id(weight) not in store.in_b_ids
                and not hasattr(input, DERIVED) and not hasattr(weight, "ds_id") and not any_autocast()
                and not isinstance(input.grad_fn, BackwardCFunction)):
            plan = GRAPH if bias is None or not bias.requires_grad or id(bias) in store.in_b_ids else GRAPH_BIAS
        else:
            key, plan = store.current, store.linear_plan(input, weight, bias)
        if plan == PLAIN:
            return F.linear(input, weight, bias)
        if plan == ROUTED:
            return _routed(store, input, weight, bias)
        bias_in_w = plan == GRAPH_BIAS
        out = F.linear(input, weight.detach(), bias.detach() if bias_in_w else bias)
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        kept: Any = input  # detached in B: the graph behind it lives until then anyway
        unpack, version = None, input._version  # autograd no longer saves the input: W's check is ours
        if hooks is not None:  # kept as autograd would keep a saved tensor: meter, offload, checkpoint see it
            kept, unpack, version = hooks[0](input.detach()), hooks[1], None
        # On the GEMM's own output: a 3-D input's output may be a view of it, and an in-place op on that view
        # would take the view's node out of the graph (a hook there would never fire).
        base = out if out._base is None else out._base
        capture = GemmCapture(store, key, kept, unpack, version, weight, bias if bias_in_w else None, base)
        # A tensor hook dict, registered as ``Tensor.register_hook`` registers one, but without the Python
        # ``RemovableHandle`` that ``register_hook`` or ``Node.register_prehook`` build on every call.
        base._backward_hooks = _LastHook(((_HOOK_KEY, capture),))
        base.grad_fn._register_hook_dict(base)
        return out


def _routed(store: GraphLinearStore, x: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    store.enter_module(+1)  # the routing's GEMM path: this module owns the deferred parameter it consumes
    try:
        with routing(store):
            return F.linear(x, weight, bias)
    finally:
        store.enter_module(-1)


def take_over(mod: nn.Module, store: GraphLinearStore) -> bool:
    """Make a plain ``nn.Linear`` (or a copy of a ``SplitLinear``) a ``SplitLinear`` on ``store``;
    False for any other module."""
    if type(mod) is nn.Linear:
        mod.__class__ = SplitLinear  # state, hooks and parameters stay; isinstance(mod, nn.Linear) holds
    elif type(mod) is not SplitLinear:
        return False
    mod._ds_vshape_bound = BoundStore(store)  # type: ignore[assignment]
    return True


_USED = object()  # what a GemmCapture keeps once its backward has run
# The capture's key in its output's hook dict: ``RemovableHandle`` ids count up from 0, so a hook the user
# adds to the same tensor later (``Tensor.register_hook`` adds it to this dict) never takes its place.
_HOOK_KEY = -1


class _LastHook(dict[int, Callable[[torch.Tensor | None], None]]):
    """An output's tensor-hook dict that keeps the capture last: autograd runs a tensor's hooks in the
    dict's order, each on what the one before returned, so the capture takes the gradient the GEMM's
    node receives also when a hook the user adds later changes it. (A Python subclass also because the
    user's ``RemovableHandle`` takes a weak reference to the dict, which a plain dict refuses.)"""

    def __setitem__(self, key: int, value: Callable[[torch.Tensor | None], None]) -> None:
        capture = self.pop(_HOOK_KEY, None)
        super().__setitem__(key, value)
        if capture is not None:
            super().__setitem__(_HOOK_KEY, capture)


class GemmCapture:
    """B's hook on a GEMM's output: hands the input W needs and the output gradient to the store.

    A tensor hook, where the node's own pre-hook would cost a Python handle per forward call: it also
    runs where autograd takes the output's gradient without running the node (``torch.autograd.grad``
    asking for that output itself). A ``torch.autograd.grad`` call the routing sees (``asks_inputs_only``)
    takes nothing. Otherwise, in a unit's B (``is_deferring``) the node runs: the engine's backward
    takes every gradient (a ``torch.autograd.grad`` asking for this output from inside a hook or a
    custom Function's backward in B, unseen by the routing, takes it first: the node's own turn then
    fails as a second backward, naming the layer). Anywhere else the
    capture waits for the node itself, through a pre-hook put on it for that backward only, so such
    a call leaves it alone as a node pre-hook would.
    """

    __slots__ = ("store", "key", "kept", "unpack", "version", "weight", "bias", "out", "out_version")

    def __init__(self, store: GraphLinearStore, key: Hashable, kept: Any, unpack: Callable[[Any], torch.Tensor] | None,
                 version: int | None, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        self.store, self.key, self.kept, self.unpack, self.version = store, key, kept, unpack, version
        self.weight, self.bias = weight, bias
        self.out, self.out_version = weakref.ref(out), out._version  # weak: the output's memory is not W's

    def __call__(self, grad: torch.Tensor | None) -> None:
        store = self.store
        if grad is None or store.asks_inputs_only:
            return None
        if store.is_deferring(self.key):
            return self._take(grad)
        out = self.out()
        node = None if out is None or out._version != self.out_version else out.grad_fn
        if node is None:  # freed, changed in place or detached since: nobody can ask for it as an input
            return self._take(grad)
        node.register_prehook(partial(self._take_in, torch._C._current_graph_task_id()))
        return None

    def _take_in(self, task: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """The node's pre-hook: takes the gradient in the backward that put it there, and in no later one."""
        if grads[0] is None or torch._C._current_graph_task_id() != task:
            return None
        return self._take(grads[0])

    def _take(self, grad: torch.Tensor) -> None:
        # Let go of it here, as autograd frees a node's saved tensors when it runs: the meter and offload
        # count it off now, and the store holds what W needs. A second backward finds nothing.
        kept, self.kept = self.kept, _USED
        if kept is _USED:
            raise RuntimeError(
                f"ds_vshape split backward: a second backward through {self.store.owner_of(self.weight)} "
                "(retain_graph) is not supported in a split unit: its first backward already handed the input "
                "to W. Run the unit's backward once, or pick a schedule without split backward")
        x = self.unpack(kept) if self.unpack is not None else kept
        # Detached now: a reentrant checkpoint's recomputed input carries its segment's graph, which
        # must not live on (its input and gradient) until B ends. Its version counter stays shared.
        self.store.capture(self, x.detach() if x.requires_grad else x, grad)
        return None

    def work(self, x: torch.Tensor, grad: torch.Tensor) -> MatmulWork:
        """What W runs for this GEMM, given its input (as B handed it over) and output gradient."""
        if self.version is not None and x._version != self.version:
            raise RuntimeError(
                f"ds_vshape split backward: the input of {self.store.owner_of(self.weight)} was modified in place "
                "after its forward, but its weight gradient needs it as the forward saw it: clone the tensor before "
                "modifying it in place (as autograd itself would demand of a saved tensor)")
        return MatmulWork("linear", x, grad, self.weight, self.bias)
