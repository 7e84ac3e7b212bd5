"""Routes every operation that consumes a trainable parameter through split backward.

Active while a unit's forward runs (and while its backward re-runs a checkpointed forward),
a ``TorchFunctionMode`` sees each torch call and sorts its tensor arguments:

* parameter-like: a trainable parameter of the stage, a tensor computed from such parameters
  only (``w.t()``, ``w.to(bf16)``, ``w[idx]``), or the output of a custom autograd Function
  fed by parameters only (``split_graph``): its gradient is W's work;
* anything else (activations, ids, masks, frozen parameters).

A call with only parameter-like tensors runs as is and its outputs become parameter-like, so
a head computing ``x @ embedding.weight.t()`` defers the embedding's gradient like a linear
layer. A call mixing both is where B and W part: GEMMs take the fast path, anything else the
generic one (``split_ops``); a call whose parameter-like tensors are all computed in B (cheap: at most
one dimension, norm scales and biases; or named in ``pipeline.weight_grads_in_b``) runs as is.
Calls without parameters, and in-place calls (their result must stay the tensor they
modify), run untouched; a parameter reached that way gets its gradient in B, which
``split_backward`` reports. Custom Functions the routing cannot enter are found here too:
every tensor a call consumes is shown to ``split_graph``.

The store is a parameter (``RoutingStore``: what the routing asks of it).
"""

from __future__ import annotations

import types
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .split_graph import IN_B, GraphStore, derived_kind, inspect_outputs
from .split_ops import MatmulCall, OpCall, deferred_op, split_matmul

__all__ = ["DeferMode", "RoutedCall", "RoutingStore", "param_like", "routing"]

_BACKWARDS = {torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward}
_GEMMS = frozenset([F.linear, torch.addmm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm])
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
# Calls that only read a tensor's metadata: they create no autograd edge, so the routing has nothing
# to sort in them, and they are a quarter of a transformer block's calls (``x.shape`` and the like).
_METADATA = frozenset(
    [v.__get__ for v in vars(torch._C.TensorBase).values() if isinstance(v, types.GetSetDescriptorType)]
    + [getattr(torch.Tensor, n) for n in ("size", "dim", "stride", "numel", "is_floating_point", "is_complex",
                                          "is_contiguous", "element_size", "storage_offset", "get_device", "__len__")])
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imatmul__",
                    "__ipow__", "__imod__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


class RoutingStore(GraphStore, Protocol):
    """What the routing asks of the store, besides what ``split_graph`` and ``split_ops`` ask."""

    @property
    def is_suspended(self) -> bool: ...

    def is_param_like(self, t: torch.Tensor) -> bool: ...

    def mark_param_like(self, out: Any, *, in_b: bool) -> None: ...

    def inputs_only(self) -> ContextManager[None]: ...


class DeferMode(TorchFunctionMode):
    """Sends the parameter-consuming calls of ``store.current``'s unit through split backward."""

    def __init__(self, store: RoutingStore) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*args, **kwargs)
        store = self.store
        if func in _BACKWARDS:
            # A unit's backward (B, or fused) starts here: custom Functions behind its roots are sorted
            # before autograd reaches them (a stage output may come straight out of one).
            if store.current is not None and not store.is_suspended:
                inspect_outputs(store, (args, kwargs.get("outputs"), kwargs.get("tensors")))
            if func is torch.autograd.grad:  # returns gradients, accumulates none: graph_linear must not either
                with store.inputs_only():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        if store.current is None or store.is_suspended or not torch.is_grad_enabled() or not _touches_params(store, args, kwargs):
            return func(*args, **kwargs)
        if func in _GEMMS:  # the common routed call, sorted before the costlier flattening below
            fast = _fast_matmul(store, func, args, kwargs)
            if fast is not None:
                if not store.in_module:
                    store.used_outside()
                return fast
        flat, spec = tree_flatten((args, kwargs))
        pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        tensors = [flat[i] for i in pos]
        is_param = [store.is_param_like(t) for t in tensors]
        in_b = [p and store.grad_in_b(t) for t, p in zip(tensors, is_param)]
        if not store.in_module and in_b != is_param:
            store.used_outside()  # a deferred parameter consumed outside the modules owning one
        if all(is_param):
            out = func(*args, **kwargs)
            store.mark_param_like(out, in_b=all(in_b))
            return out
        if _mutates(func, kwargs) or in_b == is_param:  # in place, or only parameters computed in B: B's, by design
            return func(*args, **kwargs)
        call = OpCall(func, spec, [None if isinstance(v, torch.Tensor) else v for v in flat], pos, is_param, in_b, store,
                      store.current, autocast=_autocast_state(tensors))
        return deferred_op(call, tensors)


def routing(store: RoutingStore) -> ContextManager[Any]:
    """The mode, unless it is active already or no unit is running.

    Autograd runs backward without the caller's torch-function modes, so a checkpointed
    forward re-run in B would skip them and save other tensors than the forward did (a
    non-reentrant checkpoint refuses that) and compute weight gradients in B. Module
    forwards and checkpointed functions therefore enter the mode themselves (``RoutedCall``).
    """
    if store.current is None or store.is_suspended:
        return nullcontext()
    if any(isinstance(m, DeferMode) for m in torch.overrides._get_current_function_mode_stack()):
        return nullcontext()
    return DeferMode(store)


class RoutedCall:
    """``function`` run under ``routing(store)``: what a checkpoint is handed to re-run."""

    def __init__(self, function: Callable[..., Any], store: RoutingStore) -> None:
        self.function, self.store = function, store

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with routing(self.store):
            out = self.function(*args, **kwargs)
            if self.store.current is not None and torch.is_grad_enabled():
                inspect_outputs(self.store, out)
            return out


def _touches_params(store: RoutingStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # Called for every op of the forward: a shallow look (lists one level deep, as torch.cat takes them).
    # Every argument is looked at (no early exit): a custom Function behind any of them must be found.
    found = False
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            found = param_like(store, v) or found
        elif isinstance(v, (list, tuple)):
            for t in v:
                if isinstance(t, torch.Tensor):
                    found = param_like(store, t) or found
    return found


def param_like(store: RoutingStore, t: torch.Tensor) -> bool:
    """``t`` is a parameter or computed from parameters only (a custom Function's output is sorted here)."""
    if not t.requires_grad:
        return False
    if store.is_param_like(t):
        return True
    kind = derived_kind(store, t)  # also sorts a custom Function that mixes parameters and activations
    if kind is None:
        return False
    store.mark_param_like(t, in_b=kind == IN_B)
    return True


def _mutates(func: Callable[..., Any], kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    return "out" in kwargs or name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


def _fast_matmul(store: RoutingStore, func: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``F.linear``/``x @ W``/``addmm`` with the weight (or bias) parameter-like: the GEMM fast path."""
    if func is F.linear and set(kwargs) <= {"bias"} and len(args) in (2, 3):
        x, w = args[0], args[1]
        b = args[2] if len(args) == 3 else kwargs.get("bias")
        kind, x_dims = "linear", 1
    elif func in _MATMULS and not kwargs and len(args) == 2:
        (x, w), b = args, None
        kind, x_dims = "matmul", 1 if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) else 2
    elif func is torch.addmm and not kwargs and len(args) == 3:
        b, x, w = args
        kind, x_dims = "addmm", 2
    else:
        return None
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2 and x.dim() >= 2):
        return None
    if x_dims == 2 and x.dim() != 2 or store.is_param_like(x):
        return None
    if b is not None and not (isinstance(b, torch.Tensor) and b.dim() == 1):
        return None
    if not store.is_param_like(w) or store.grad_in_b(w) or (b is not None and b.requires_grad and not store.is_param_like(b)):
        # An activation as the weight (attention scores @ V) is not a parameter's GEMM; a weight computed
        # from parameters computed in B only gets its gradient in B (the caller runs the call as is).
        return None
    return split_matmul(MatmulCall(kind, store, store.current, bias_in_b=b is None or store.grad_in_b(b)), x, w, b)


def _autocast_state(tensors: list[torch.Tensor]) -> tuple[str, bool, torch.dtype] | None:
    """The autocast the call runs under, so that B's re-run computes the same values."""
    device = tensors[0].device.type
    if device not in ("cuda", "cpu", "xpu", "hpu", "mps") or not torch.is_autocast_enabled(device):
        return None
    return device, True, torch.get_autocast_dtype(device)
