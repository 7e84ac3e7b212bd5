"""A scope's later forwards route only the modules owning deferred parameters, and stay exact.

The first forward of a scope (a model stage) routes every call; when every deferred parameter
was consumed inside a module owning one, later forwards route only those modules' calls. A
parameter consumed elsewhere keeps the scope routed whole; one the routing missed (used
elsewhere only later) is computed in B, warned about, and routes whole forwards from then on.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_vshape.runtime.split import split_mode
from ds_vshape.runtime.split.split_backward import SplitBackwardWarning, WeightGradStore, enable_split_backward

DIM = 8


class _Linear(torch.autograd.Function):
    """A linear layer as one custom Function (as fused and tensor-parallel kernels are)."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        x, w = ctx.saved_tensors
        return (g @ w if ctx.needs_input_grad[0] else None, g.t() @ x if ctx.needs_input_grad[1] else None)


class Block(nn.Module):
    """Linears and a norm in children, elementwise work in the block itself; ``tied``: the block
    also consumes its first linear's weight itself (outside the module owning it)."""

    def __init__(self, *, tied: bool = False, checkpointed: bool = False, function: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.norm = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM), nn.LayerNorm(DIM)
        self.tied, self.checkpointed, self.function = tied, checkpointed, function

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        h = torch.tanh(_Linear.apply(n, self.fc1.weight) if self.function else self.fc1(n)) * 0.5
        out = x + self.fc2(h)
        return out + F.linear(h, self.fc1.weight.t()) if self.tied else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


@contextmanager
def _counting() -> Iterator[list[int]]:
    """How many calls the routing mode sees."""
    calls = [0]
    original = split_mode.DeferMode.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return original(self, func, types, args, kwargs)

    split_mode.DeferMode.__torch_function__ = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        split_mode.DeferMode.__torch_function__ = original  # type: ignore[method-assign]


def _step(model: Block, store: WeightGradStore, reference: Block, key: int, *, scope: str) -> int:
    """One micro-batch through F, B, W and through the reference; returns the calls routed in F."""
    g = torch.Generator().manual_seed(key)
    x, grad = torch.randn(3, DIM, generator=g), torch.randn(3, DIM, generator=g)
    reference(x.clone().requires_grad_(True)).backward(grad)
    with _counting() as calls, store.forward_of(key, scope=scope):
        out = model(x.clone().requires_grad_(True))
    routed = calls[0]
    with store.deferring(key):
        out.backward(grad)
    assert model.fc1.weight.grad is None or key > 0  # deferred: nothing lands in B on the first step
    store.run(key)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
    return routed


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_later_forwards_route_only_the_owning_modules(checkpointed: bool) -> None:
    model, store = Block(checkpointed=checkpointed), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitBackwardWarning)
        routed = [_step(model, store, reference, k, scope="stage") for k in range(3)]
    assert routed[1] == routed[2] < routed[0]  # the block's own elementwise calls are no longer routed


@pytest.mark.parametrize("use", ["tied", "function"])
def test_a_parameter_used_outside_its_module_keeps_the_scope_routed_whole(use: str) -> None:
    # Through a routed call (a tied GEMM) or a custom Function the block applies to its child's weight.
    model, store = Block(**{use: True}), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitBackwardWarning)
        routed = [_step(model, store, reference, k, scope="stage") for k in range(3)]
    assert routed[0] == routed[1] == routed[2]


def test_a_use_the_routing_missed_is_exact_warned_and_routes_whole_forwards_after() -> None:
    model, store = Block(), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    first = _step(model, store, reference, 0, scope="stage")
    model.tied = reference.tied = True  # the use appears only now, while only modules are routed
    with pytest.warns(SplitBackwardWarning, match="fc1"):
        _step(model, store, reference, 1, scope="stage")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitBackwardWarning)
        again = _step(model, store, reference, 2, scope="stage")
    assert again > first  # whole again: the tied use adds routed calls


def test_each_scope_learns_alone() -> None:
    model, store = Block(), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    a = [_step(model, store, reference, k, scope="a") for k in range(2)]
    b = _step(model, store, reference, 2, scope="b")
    assert b == a[0] > a[1]


def test_partial_functions_of_modules_are_routed_like_the_module() -> None:
    # DeepSpeed's TiedLayerSpec calls forward_fn(module, x): a use outside the module's own forward.
    model, store = Block(), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    head = partial(lambda m, x: F.linear(x, m.fc2.weight.t()), model)
    ref_head = partial(lambda m, x: F.linear(x, m.fc2.weight.t()), reference)
    for key in range(2):
        g = torch.Generator().manual_seed(key)
        x, grad = torch.randn(3, DIM, generator=g), torch.randn(3, 2 * DIM, generator=g)
        ref_head(reference(x.clone().requires_grad_(True))).backward(grad)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SplitBackwardWarning)
            with store.forward_of(key, scope="stage"):
                out = head(model(x.clone().requires_grad_(True)))
            with store.deferring(key):
                out.backward(grad)
        store.run(key)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
