"""How a linear layer's split runs, as the host-cost fast paths take it (issue 28).

* ``SplitLinear.forward`` checks the common call itself instead of asking ``linear_plan``: for
  every kind of call the way it runs must be the plan the store gives.
* W adds a GEMM's gradients into ``.grad`` itself where no hook waits on them; a parameter with a
  hook of its own (post-accumulate, tensor) accumulates through autograd's engine so the hook runs.
  Both ways give the same bits.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from ds_vshape.runtime.split import split_backward
from ds_vshape.runtime.split.graph_linear import _HOOK_KEY, DERIVED, GRAPH, GRAPH_BIAS, PLAIN, ROUTED, Plan
from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward
from tests.unit.test_graph_linear import DIM, Block, _custom_nodes, _inputs, _Scale, _split, _warm


def _ran_as(fc: nn.Linear, x: torch.Tensor) -> Plan:
    """How ``fc(x)`` ran, read off its output: a routed node or mark, the capture on the GEMM's output, or neither."""
    out = fc(x)
    if any(n.startswith(("_SplitMatmul", "_DeferredOp")) for n in _custom_nodes(out)):  # ds_vshape's own (not the input's)
        return ROUTED
    if hasattr(out, DERIVED):  # routed, and computed from parameters only: it ran as it is, marked
        return ROUTED
    base = out if out._base is None else out._base
    hooks = base._backward_hooks or {}
    if _HOOK_KEY not in hooks:
        return PLAIN
    return GRAPH_BIAS if hooks[_HOOK_KEY].bias is not None else GRAPH


def _cases(block: Block, store: WeightGradStore) -> list[tuple[str, Any, torch.Tensor]]:
    """(name, context, input) for fc1: each kind of call the plan tells apart."""
    x = _inputs(1)[0].requires_grad_()
    nograd, autocast = torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16)
    return [("3-D", None, x), ("2-D", None, x[0]), ("1-D", None, x[0, 0]), ("no grad", nograd, x),
            ("input without gradient", None, x.detach()), ("autocast", autocast, x),
            ("computed from a parameter", None, _Scale.apply(block.fc1.weight)),
            ("a custom Function's output", None, _Scale.apply(x)), ("suspended", store.suspended(), x)]


@pytest.mark.parametrize("cheap_in_b", [True, False])
def test_the_forward_runs_each_kind_of_call_as_the_store_plans_it(cheap_in_b: bool) -> None:
    block = Block()
    store = WeightGradStore(cheap_in_b=cheap_in_b)
    enable_split_backward([block], store)
    _warm(block, store)
    fc = block.fc1
    seen = set()
    for key, (name, context, x) in enumerate(_cases(block, store), start=10):
        with store.forward_of(key, scope="stage"), context or nullcontext():
            want = store.linear_plan(x, fc.weight, fc.bias)
            assert _ran_as(fc, x) == want, name
        seen.add(want)
        assert _ran_as(fc, x) == PLAIN == store.linear_plan(x, fc.weight, fc.bias), f"{name}, outside any unit"
    assert seen == {PLAIN, ROUTED, GRAPH_BIAS if not cheap_in_b else GRAPH}
    asked = []
    real_plan = store.linear_plan
    store.linear_plan = lambda *a: asked.append(a) or real_plan(*a)  # type: ignore[method-assign]
    with store.forward_of(50, scope="stage"):
        assert _ran_as(fc, _inputs(1)[0].requires_grad_()) in (GRAPH, GRAPH_BIAS)
    assert asked == []  # the common call never asks the store
    del store.linear_plan
    fc.weight.ds_id = 0  # what ZeRO-3 marks a partitioned parameter with
    try:
        with store.forward_of(99, scope="stage"):
            x = _inputs(1)[0].requires_grad_()
            assert _ran_as(fc, x) == ROUTED == store.linear_plan(x, fc.weight, fc.bias)
    finally:
        del fc.weight.ds_id
    store.compute_in_b([fc.weight])  # the fit moved its gradient to B
    with store.forward_of(100, scope="stage"):
        x = _inputs(1)[0].requires_grad_()
        assert _ran_as(fc, x) == store.linear_plan(x, fc.weight, fc.bias) == (PLAIN if cheap_in_b else ROUTED)
    with store.forward_of(101, scope="another scope"):  # a scope's first forward is routed whole
        assert _ran_as(block.fc2, _inputs(1)[0].repeat(1, 1, 3).requires_grad_()) == ROUTED
    store.clear()


def _trained(hook: str | None, *, micro_batches: int = 3, cheap_in_b: bool = True, block: nn.Module | None = None,
             dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """Grads after F and B of each micro-batch, then the Ws, twice over (the second time into ``.grad``
    already there); the post-accumulate hooks' calls; the autograd accumulations W ran."""
    block = (block or Block()).to(dtype)
    store = WeightGradStore(cheap_in_b=cheap_in_b)
    enable_split_backward([block], store)
    fired: list[str] = []
    for name, p in block.named_parameters():
        if p.dim() < 2:
            continue
        if hook == "post":
            p.register_post_accumulate_grad_hook(lambda q, name=name: fired.append(name))
        elif hook == "tensor":
            p.register_hook(lambda g: None if g is None else g * 2.0)
        elif hook == "removed":
            p.register_hook(lambda g: g * 2.0).remove()
            p.register_post_accumulate_grad_hook(lambda q: None).remove()
    calls = 0
    real = split_backward._accumulate

    def counted(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        nonlocal calls
        calls += bool(batch)
        real(batch)

    split_backward._accumulate = counted
    try:
        _split(block, store, [x.to(dtype) for x in _inputs(micro_batches)])
        _split(block, store, [x.to(dtype) for x in _inputs(micro_batches)])
    finally:
        split_backward._accumulate = real
    return {n: p.grad.clone() for n, p in block.named_parameters()}, fired, calls


@pytest.mark.parametrize("cheap_in_b", [True, False])  # off: the biases' gradients are W's too
def test_w_adds_into_grad_itself_with_the_bits_autograd_would(cheap_in_b: bool) -> None:
    direct, fired, calls = _trained(None, cheap_in_b=cheap_in_b)
    through_autograd, fired_post, calls_post = _trained("post", cheap_in_b=cheap_in_b)  # a hook on each: the engine
    assert calls == 0 and fired == []
    # Once per W (2 rounds of 3 micro-batches), and once in the B of the scope's first forward (routed whole):
    # its GEMM node hands autograd None for the weight, and autograd calls the hook all the same.
    assert calls_post > 0 and fired_post.count("fc1.weight") == fired_post.count("fc2.weight") == 7
    assert set(direct) == {n for n, _ in Block().named_parameters()}
    for name in direct:
        assert torch.equal(direct[name], through_autograd[name]), name
    removed, _, calls_removed = _trained("removed", cheap_in_b=cheap_in_b)  # hooks put on and taken off: none waits
    assert calls_removed == 0
    for name in direct:
        assert torch.equal(direct[name], removed[name]), name


def test_a_tensor_hook_on_a_weight_changes_what_w_adds() -> None:
    direct, _, _ = _trained(None)
    doubled, _, calls = _trained("tensor")
    assert calls > 0
    for name, g in direct.items():
        if g.dim() == 2:
            torch.testing.assert_close(doubled[name], 2 * g, rtol=0, atol=0, msg=name)
        else:
            assert torch.equal(doubled[name], g), name


def test_bf16_weights_take_the_direct_path_with_the_same_bits() -> None:
    direct, _, calls = _trained(None, dtype=torch.bfloat16)
    through_autograd, _, calls_post = _trained("post", dtype=torch.bfloat16)
    assert calls == 0 < calls_post
    for name, g in direct.items():
        assert g.dtype == torch.bfloat16 and torch.equal(g, through_autograd[name]), name


class _CalledTwice(nn.Module):
    """``fc`` applied twice in a unit: two works for one weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.fc(x)))


class _Tied(nn.Module):
    """``fc1``'s weight used by its own layer and, transposed, by a routed GEMM after it (a tied head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(DIM, 3 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.tanh(self.fc1(x)), self.fc1.weight.t())


@pytest.mark.parametrize("model", [_CalledTwice, _Tied])
def test_a_weight_in_two_works_of_a_unit_sums_them_before_adding_as_autograd_does(model: type[nn.Module]) -> None:
    """A fused backward sums a weight's two gradients before adding them into ``.grad``; W's batch through
    autograd does too (one by one, the last bits differ): such a unit takes it, with the bits it gave before."""
    split, _, calls = _trained(None, block=model())
    through_autograd, _, _ = _trained("post", block=model())
    assert calls > 0
    for name, g in split.items():
        assert torch.equal(g, through_autograd[name]), name
    if model is _CalledTwice:  # (the tied one's order of the two sums is the batch's, not the fused backward's)
        reference = model()
        for x in _inputs(3) * 2:
            reference(x.clone().requires_grad_()).square().sum().backward()
        for name, p in reference.named_parameters():
            assert torch.equal(split[name], p.grad), name


def test_a_weight_frozen_before_w_gets_no_gradient_and_an_autocast_gemm_goes_through_autograd() -> None:
    block = Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    _warm(block, store)
    leaf = _inputs(1)[0].requires_grad_()
    with store.forward_of(5, scope="stage"), torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(leaf)  # routed: x and the output gradient in bf16, the weight fp32
    with store.deferring(5):
        out.float().sum().backward()
    block.fc1.weight.requires_grad_(False)
    calls = []
    real = split_backward._accumulate
    split_backward._accumulate = lambda batch: calls.append(len(batch)) or real(batch)
    try:
        store.run(5)
    finally:
        split_backward._accumulate = real
    assert block.fc1.weight.grad is None
    assert block.fc2.weight.grad is not None and block.fc2.weight.grad.dtype == torch.float32 and sum(calls) > 0
