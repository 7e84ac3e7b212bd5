"""The hooks through which a module's forward (and a checkpoint's re-run in B) enters the routing.

``split_backward.enable_split_backward`` puts them on the modules owning deferred parameters
(other than a plain ``nn.Linear``, which ``graph_linear`` takes over) and on a stage's own
modules, and wraps DeepSpeed's checkpoint function; the store is a parameter.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import wraps
from typing import Any, Callable, Protocol

import torch
from torch import nn

from .split_graph import inspect_outputs
from .split_mode import RoutedCall, RoutingStore, routing

__all__ = ["HookStore", "route_forward", "routed_checkpoint"]


class HookStore(RoutingStore, Protocol):
    """What the module hooks ask of the store, besides the routing's questions."""

    def routed_whole(self) -> bool: ...

    def enter_module(self, delta: int) -> None: ...


def route_forward(mod: nn.Module, store: HookStore, *, owner: bool) -> None:
    """The module's forward enters the routing itself: also when a checkpoint re-runs it in B.

    Hooks rather than a patched ``forward``: a deep copy of the module stays a module of its own.
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


def routed_checkpoint(checkpoint_func: Callable[..., Any], store: HookStore) -> Callable[..., Any]:
    """DeepSpeed's checkpoint function, re-running the checkpointed block (functions included) routed."""
    if getattr(checkpoint_func, "_ds_vshape_routed", False):
        return checkpoint_func

    @wraps(checkpoint_func)
    def routed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint_func(RoutedCall(function, store), *args, **kwargs)

    routed._ds_vshape_routed = True  # type: ignore[attr-defined]
    return routed
