"""The autograd functions behind split backward: one per operation that consumes a parameter.

Each function sits where a trainable parameter (or a tensor computed from parameters only,
see ``split_mode``) meets the activations. Its backward has two modes:

* fused (the unit is not deferring): input and parameter gradients at once, as autograd would;
* B (the unit is deferring): the input gradients, and the gradients of the parameters that
  B computes by design (``in_b``: norm scales and biases); what the other parameters'
  gradients need is parked in the store as a ``ParkedWork``, whose ``run()`` (the unit's W)
  accumulates them into ``.grad`` through autograd's engine on the parameter (``accumulate``), so
  DeepSpeed's accumulate hooks and the bf16 optimizer see them exactly as from a fused backward
  (a GEMM's, where no hook waits, the store adds itself: ``MatmulWork.add_to_grads``).

``_SplitMatmul`` is the fast path for the GEMMs (``F.linear``, ``x @ W``, ``addmm``): B is one
GEMM (plus the bias's row sum), W one GEMM, and it parks the input (the very tensor autograd
saved) and the output gradient. ``_DeferredOp`` serves any other operation: it saves its inputs
like any op, and its backward re-runs the operation on detached leaves (cheap: embeddings,
elementwise scales), takes the input gradients of that small graph and, under B, keeps the
graph until W, which takes the parameter gradients from it. Both save activations with
``save_for_backward``, so non-reentrant activation checkpointing recomputes them like any
other saved tensor.

The store is a parameter of every call here (``OpStore``: what these functions ask of it);
``split_backward.WeightGradStore`` is the one implementation.
"""

from __future__ import annotations

from collections.abc import Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

__all__ = ["accumulate", "deferred_op", "GenericWork", "MatmulCall", "MatmulWork", "OpCall", "OpStore",
    "ParkedWork", "split_matmul"]


class ParkedWork(Protocol):
    """Weight-gradient work parked by B: ``held`` are the tensors it keeps alive until ``run``."""

    held: tuple[torch.Tensor, ...]

    def run(self) -> None: ...


class OpStore(Protocol):
    """What the split functions ask of the store that owns the parked work."""

    def is_deferring(self, key: Hashable) -> bool: ...

    def park(self, key: Hashable, work: ParkedWork) -> None: ...

    def suspended(self) -> AbstractContextManager[None]: ...


def accumulate(targets: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """Add ``grads`` into the parameters behind ``targets`` (parameters, or tensors computed from them).

    Backward on the parameter itself (not ``.grad +=``) so that post-accumulate hooks fire.
    A target computed from parameters (``w.t()``, ``w.to(bf16)``) may feed several operations;
    its small graph is kept for the next one's W.
    """
    pairs = [(t, g if g.dtype == t.dtype else g.to(t.dtype)) for t, g in zip(targets, grads) if g is not None and t.requires_grad]
    if pairs:
        retain = any(not t.is_leaf for t, _ in pairs)
        tensors, grads_ = tuple(t for t, _ in pairs), tuple(g for _, g in pairs)
        if _run_backward is None:
            torch.autograd.backward(list(tensors), list(grads_), retain_graph=retain)
        else:
            # The engine itself: ``torch.autograd.backward`` re-checks every gradient's shape in Python,
            # a cost per parameter that W would pay on every pass; these are computed to match.
            _run_backward(tensors, grads_, retain, False, (), allow_unreachable=True, accumulate_grad=True)


_run_backward: Callable[..., Any] | None = getattr(torch.autograd.graph, "_engine_run_backward", None)


class _Internal:
    """Marks ds_vshape's own Functions: ``split_graph`` leaves their nodes alone."""

    _ds_vshape_internal = True


# ---- fast path: GEMMs with a parameter as the weight ------------------------------------------
@dataclass
class MatmulCall:
    """``kind``: "linear" (y = x W^T + b), "matmul" (y = x W), "addmm" (y = b + x W; x is 2-D).

    ``bias_in_b``: the bias's gradient is computed in B (by design), not parked for W.
    """

    kind: str
    store: OpStore
    key: Hashable
    bias_in_b: bool = True


@dataclass
class MatmulWork:
    kind: str
    x: torch.Tensor | None
    grad_out: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    held: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        self.held = tuple(t for t in (self.x, self.grad_out) if t is not None)

    def gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, gradient) pairs, for the store to accumulate with other works' in one autograd call."""
        grad_w, grad_b = _weight_grads(self.kind, self.x, self.grad_out, want_w=self.weight is not None,
                                       want_b=self.bias is not None)
        return [(t, g) for t, g in ((self.weight, grad_w), (self.bias, grad_b)) if t is not None and g is not None]

    def run(self) -> None:
        pairs = self.gradients()
        accumulate([t for t, _ in pairs], [g for _, g in pairs])

    def add_to_grads(self, *, own_hooks: dict[int, int]) -> bool:
        """Add the gradients into ``.grad`` directly, without an autograd call (a first gradient becomes
        ``.grad`` itself, as autograd would take it over); False, doing nothing, where autograd must
        (``gradients`` then): a hook of any kind but the store's own (``own_hooks``: parameter id to its
        key in the hook dict), a dtype that differs, a tensor that records history. (``run`` always goes
        through autograd: the fit's share of W run in B, a fused backward's capture.)"""
        grad, x, weight, bias = self.grad_out, self.x, self.weight, self.bias
        if grad.requires_grad or not (_plain_leaf(weight, own_hooks) and _plain_leaf(bias, own_hooks)):
            return False
        if (bias is not None and bias.dtype != grad.dtype) or (
                weight is not None and (x is None or x.requires_grad or not x.dtype == grad.dtype == weight.dtype)):
            return False
        grad_w, grad_b = _weight_grads(self.kind, x, grad, want_w=weight is not None, want_b=bias is not None)
        for t, g in ((weight, grad_w), (bias, grad_b)):
            if t is None or g is None:
                continue
            if t.grad is None:
                t.grad = g
            else:  # the product, then the sum: the bits autograd's accumulation gives (addmm_ would round otherwise)
                t.grad.add_(g)
        return True


def _plain_leaf(t: torch.Tensor | None, own_hooks: dict[int, int]) -> bool:
    """Autograd would add ``t``'s gradient into its ``.grad`` in place and run nothing else: a contiguous
    leaf without hooks (``own_hooks`` names the store's own: a no-op outside B), its ``.grad`` absent or
    plain. (Hooks put on its AccumulateGrad node itself cannot be seen from Python: not supported.)"""
    if t is None:
        return True
    if not t.is_leaf or not t.requires_grad or t._post_accumulate_grad_hooks or not t.is_contiguous():
        return False
    if hasattr(t, "ds_id"):  # ZeRO-3's partitioned parameter: its gradient is DeepSpeed's to place
        return False
    hooks = t._backward_hooks
    if hooks and (len(hooks) > 1 or own_hooks.get(id(t)) not in hooks):
        return False
    g = t.grad
    if g is None:  # what W assigns must be what autograd would: a grad_dtype of its own is autograd's to cast to
        return getattr(t, "grad_dtype", t.dtype) == t.dtype
    return g.dtype == t.dtype and g.layout == torch.strided and not g.requires_grad  # the device: the setter's


def _weight_grads(kind: str, x: torch.Tensor | None, grad_out: torch.Tensor, *, want_w: bool,
                  want_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    grad_w = None
    if want_w and x is not None:
        # In the gradient's dtype: under autocast the forward GEMM ran in it too.
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.dtype == g2.dtype else x2.to(g2.dtype)
        grad_w = g2.t().matmul(x2) if kind == "linear" else x2.t().matmul(g2)
    return grad_w, (g2.sum(0) if want_b else None)


class _SplitMatmul(_Internal, torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: MatmulCall, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.call, ctx.weight, ctx.bias = call, weight, bias  # parameters: not activation memory
        ctx.save_for_backward(x)
        if call.kind == "linear":
            return F.linear(x, weight, bias)
        if call.kind == "addmm":
            return torch.addmm(bias, x, weight) if bias is not None else torch.mm(x, weight)
        return torch.matmul(x, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        call, weight = ctx.call, ctx.weight
        need_x, need_w, need_b = ctx.needs_input_grad[1:4]
        grad_x = None
        if need_x:
            w = weight.to(grad_out.dtype)
            grad_x = grad_out.matmul(w if call.kind == "linear" else w.t())
        if call.store.is_deferring(call.key):
            bias_in_w = need_b and not call.bias_in_b
            if need_w or bias_in_w:
                call.store.park(call.key, MatmulWork(call.kind, x.detach() if need_w else None, grad_out.detach(),
                                                      weight if need_w else None, ctx.bias if bias_in_w else None))
            _, grad_b = _weight_grads(call.kind, None, grad_out, want_w=False, want_b=need_b and call.bias_in_b)
            return None, grad_x, None, grad_b
        grad_w, grad_b = _weight_grads(call.kind, x, grad_out, want_w=need_w, want_b=need_b)
        return None, grad_x, grad_w, grad_b


def split_matmul(call: MatmulCall, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _SplitMatmul.apply(call, x, weight, bias)


# ---- generic path: any operation, re-run in B on detached leaves ---------------------------------
@dataclass
class OpCall:
    """One operation's call with its tensors taken out: ``flat`` holds the non-tensor leaves."""

    func: Callable[..., Any]
    spec: TreeSpec
    flat: list[Any]
    tensor_pos: list[int]
    is_param: list[bool]  # per tensor: a trainable parameter or a tensor computed from them only
    in_b: list[bool]  # per tensor: a parameter whose gradient B computes by design (norm scale, bias, weight_grads_in_b)
    store: OpStore
    key: Hashable
    autocast: tuple[str, bool, torch.dtype] | None = None
    out_spec: TreeSpec | None = None
    out_flat: list[Any] = field(default_factory=list)  # non-tensor outputs; None where a tensor goes
    out_tensor: list[bool] = field(default_factory=list)

    def call(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        flat = list(self.flat)
        for pos, t in zip(self.tensor_pos, tensors):
            flat[pos] = t
        args, kwargs = tree_unflatten(flat, self.spec)
        return self.func(*args, **kwargs)

    def rebuild(self, outputs: tuple[torch.Tensor, ...]) -> Any:
        """The operation's result with the function's tensor outputs put back in place."""
        it = iter(outputs)
        return tree_unflatten([next(it) if is_t else v for v, is_t in zip(self.out_flat, self.out_tensor)], self.out_spec)


@dataclass
class GenericWork:
    roots: list[GradientEdge]
    grads: list[torch.Tensor]
    leaves: list[torch.Tensor]  # detached leaves standing for the parameters in the re-run graph
    targets: list[torch.Tensor]  # the parameters (or parameter-computed tensors) themselves
    held: tuple[torch.Tensor, ...]

    def run(self) -> None:
        grads = torch.autograd.grad(self.roots, self.leaves, self.grads, allow_unused=True)
        accumulate(self.targets, list(grads))


class _DeferredOp(_Internal, torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: OpCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.call = call
        ctx.set_materialize_grads(False)  # outputs nobody used get None, not a zero tensor to re-run for
        ctx.params = [t if p else None for t, p in zip(tensors, call.is_param)]
        ctx.save_for_backward(*[None if p else t for t, p in zip(tensors, call.is_param)])
        flat, call.out_spec = tree_flatten(call.call(tensors))
        call.out_tensor = [isinstance(v, torch.Tensor) for v in flat]
        call.out_flat = [None if t else v for v, t in zip(flat, call.out_tensor)]
        for i, v in enumerate(flat):
            if isinstance(v, torch.Tensor) and any(v is t for t in tensors):
                flat[i] = v.view_as(v)  # an input handed back: the function's output must be its own
        outs = tuple(v for v in flat if isinstance(v, torch.Tensor))
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        call = ctx.call
        saved = ctx.saved_tensors  # before anything else: a checkpoint recomputes them here
        tensors = [p if p is not None else s for p, s in zip(ctx.params, saved)]
        need = ctx.needs_input_grad[1:]
        leaves = [t.detach().requires_grad_(n) for t, n in zip(tensors, need)]
        held: list[torch.Tensor] = []
        outs = _rerun(call, tuple(leaves), held)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if not pairs:
            return (None,) * (1 + len(tensors))
        deferring = call.store.is_deferring(call.key)
        in_b = [i for i, n in enumerate(need) if n and (not call.is_param[i] or call.in_b[i] or not deferring)]
        in_w = [i for i, n in enumerate(need) if n and call.is_param[i] and not call.in_b[i] and deferring]
        roots, root_grads = [o for o, _ in pairs], [g for _, g in pairs]
        result: list[Any] = [None] * len(tensors)
        if in_b:
            got = torch.autograd.grad(roots, [leaves[i] for i in in_b], root_grads, allow_unused=True, retain_graph=bool(in_w))
            for i, g in zip(in_b, got):
                result[i] = g
        if in_w:
            edges = [get_gradient_edge(o) for o in roots]  # keeps the nodes, not the outputs' memory
            call.store.park(call.key, GenericWork(edges, [g.detach() for g in root_grads], [leaves[i] for i in in_w],
                                                   [tensors[i] for i in in_w], tuple(held) + tuple(root_grads)))
        return (None, *result)


def _rerun(call: OpCall, leaves: tuple[torch.Tensor, ...], held: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the operation again with autograd on; ``held`` gets what its graph saves (for the meter)."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        held.append(t)
        return t

    autocast = torch.autocast(call.autocast[0], dtype=call.autocast[2], enabled=call.autocast[1]) if call.autocast else None
    with call.store.suspended(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if autocast is not None:
            with autocast:
                out = call.call(leaves)
        else:
            out = call.call(leaves)
    return [v for v in tree_flatten(out)[0] if isinstance(v, torch.Tensor)]


def deferred_op(call: OpCall, tensors: list[torch.Tensor]) -> Any:
    return call.rebuild(_DeferredOp.apply(call, *tensors))
