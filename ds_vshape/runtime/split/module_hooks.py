"""How a module's forward (and a checkpoint's re-run in B) enters the routing.

``split_backward.enable_split_backward`` puts hooks on the modules owning deferred parameters
(other than a plain ``nn.Linear``, which ``graph_linear`` takes over), makes a stage's own
modules that own none ``RoutedStage`` s, and wraps DeepSpeed's checkpoint function; the store
is a parameter.

A stage's own module (a decoder block) needs the routing only where its unit's forward was
routed whole: a checkpoint re-running it in B must then save what the forward saved, and the
outputs of custom Functions it applies are sorted as it returns. After a stage's first forward
that is rare (``split_backward``'s scope), yet forward hooks would cost every block of every
split forward their Python calls and ``nn.Module``'s slow call path. ``RoutedStage`` instead
gives the module a subclass of its own class (as ``SplitLinear`` does for a linear layer: state,
parameters and the user's hooks stay) whose ``forward`` asks the store once and otherwise is the
class's own.
"""

from __future__ import annotations

import types
from contextlib import nullcontext
from functools import update_wrapper, wraps
from typing import Any, Callable, Protocol

import torch
from torch import nn

from .graph_linear import BoundStore
from .split_graph import inspect_outputs
from .split_mode import RoutedCall, RoutingStore, routing

__all__ = ["HookStore", "RoutedStage", "route_forward", "route_stage", "routed_checkpoint"]


class HookStore(RoutingStore, Protocol):
    """What the module hooks ask of the store, besides the routing's questions."""

    def routed_whole(self) -> bool: ...

    def enter_module(self, delta: int) -> None: ...


def route_forward(mod: nn.Module, store: HookStore, *, owner: bool) -> None:
    """The module's forward enters the routing itself: also when a checkpoint re-runs it in B.

    Hooks rather than a ``forward`` set on the instance: a deep copy would call the original's.
    """
    if getattr(mod, "_ds_vshape_store", None) is not None:
        return
    entered: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        # An owner routes its own calls; a stage's module routes when its unit's forward was routed
        # whole (a checkpoint re-running it in B must save what the forward saved).
        context = routing(store) if owner or store.routed_whole() else nullcontext()
        context.__enter__()
        entered.append(context)
        if owner:
            store.enter_module(+1)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if store.current is not None and not store.is_suspended and torch.is_grad_enabled():
            inspect_outputs(store, output)  # a custom Function's output that no routed call consumed
        if owner:  # after: a Function applied in this module was applied inside it
            store.enter_module(-1)
        if entered:
            entered.pop().__exit__(None, None, None)

    mod._ds_vshape_store = store  # type: ignore[assignment]
    mod.register_forward_pre_hook(enter)
    mod.register_forward_hook(leave, always_call=True)  # also when the forward raises


class RoutedStage:
    """Put before a stage module's own class (``route_stage``): its forward enters the routing only
    where the running unit's forward was routed whole, and sorts its outputs' custom Functions then.
    (A forward routed by its modules only needs neither: a Function that takes a deferred parameter
    outside the modules owning one keeps its scope routed whole. The module's own forward hooks now
    run outside the routing; those of a whole-routed forward run inside the stage's mode anyway.)"""

    _ds_vshape_bound: BoundStore[HookStore]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        store = self._ds_vshape_bound.store
        if not store.routed_whole():  # also when no unit runs
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        with routing(store):
            out = super().forward(*args, **kwargs)  # type: ignore[misc]
            if store.current is not None and not store.is_suspended and torch.is_grad_enabled():
                inspect_outputs(store, out)  # a custom Function's output that no routed call consumed
        return out


_STAGE_CLASSES: dict[type, type] = {}  # a module class -> its RoutedStage subclass, made once


def route_stage(mod: nn.Module, store: HookStore) -> bool:
    """Make ``mod`` (a stage's own module owning no deferred parameter) a ``RoutedStage`` on ``store``,
    or re-bind one (a deep copy shares its store until then); False where its class cannot be swapped."""
    if not isinstance(mod, RoutedStage):
        if "forward" in vars(mod):  # a forward set on the instance would pass the class's by: hooks then
            return False
        cls = type(mod)
        try:
            sub = _STAGE_CLASSES.get(cls) or _STAGE_CLASSES.setdefault(cls, _stage_class(cls))
            mod.__class__ = sub
        except TypeError:  # a class with a layout or a metaclass of its own: hooks then
            return False
    mod._ds_vshape_bound = BoundStore(store)  # type: ignore[assignment]
    return True


def _stage_class(cls: type) -> type:
    """``cls`` behind ``RoutedStage``, named as ``cls`` (messages and reprs name the user's class), its
    ``forward`` showing ``cls.forward``'s signature (``inspect.signature`` follows ``__wrapped__``)."""
    base = RoutedStage.forward
    # A copy of the function, its closure included (``super()``'s cell: RoutedStage), for this class alone.
    forward = types.FunctionType(base.__code__, base.__globals__, base.__name__, base.__defaults__, base.__closure__)
    update_wrapper(forward, cls.forward)
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "forward": forward}
    return type(cls.__name__, (RoutedStage, cls), namespace)


def routed_checkpoint(checkpoint_func: Callable[..., Any], store: HookStore) -> Callable[..., Any]:
    """DeepSpeed's checkpoint function, re-running the checkpointed block (functions included) routed."""
    if getattr(checkpoint_func, "_ds_vshape_routed", False):
        return checkpoint_func

    @wraps(checkpoint_func)
    def routed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint_func(RoutedCall(function, store), *args, **kwargs)

    routed._ds_vshape_routed = True  # type: ignore[attr-defined]
    return routed
