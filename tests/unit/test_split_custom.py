"""Split backward through custom autograd Functions: B asks for input gradients, W for the parameters'.

Each test runs a stage as the engine does (forward under ``forward_of``, B under ``deferring``,
W by ``run``) beside a deep copy trained with a plain backward, and records which gradients
each Function's backward was asked for in which pass. The Functions are written here, in the
shapes real ones take: a fake-quantizer taking the parameter alone, a linear taking activation,
weight and bias (honouring ``ctx.needs_input_grad``, or computing everything anyway as
Megatron's does), a Function with two outputs, and a tensor-parallel column/row pair whose
backward all-reduces (a gloo group of one process: the all-reduce calls are counted).
"""

from __future__ import annotations

import copy
import functools
import gc
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_vshape.runtime.measuring.memory import ActivationMeter
from ds_vshape.runtime.split.split_backward import SplitBackwardWarning, WeightGradStore, enable_split_backward

DIM, ROWS = 8, 6
TOL = 1e-6
ASKED: list[tuple[str, tuple[bool, ...]]] = []  # (Function, needs_input_grad) per backward call
ALL_REDUCES: list[str] = []


def _asked(name: str) -> list[tuple[bool, ...]]:
    return [needs for fn, needs in ASKED if fn == name]


class Quantize(torch.autograd.Function):
    """Takes the parameter alone: a straight-through fake quantizer with a saved per-row scale."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        scale = w.abs().amax(dim=1, keepdim=True) + 1.0
        ctx.save_for_backward(scale)
        return torch.round(w / scale * 64) / 64 * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ASKED.append(("Quantize", ctx.needs_input_grad))
        (scale,) = ctx.saved_tensors
        return grad * (1.0 + 0.0 * scale)  # straight through, using what it saved


class Linear(torch.autograd.Function):
    """Activation, weight and bias in one node; computes only the gradients it is asked for."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ASKED.append(("Linear", ctx.needs_input_grad))
        return _linear_grads(ctx, grad, ctx.needs_input_grad)


class EagerLinear(Linear):
    """The same, computing every gradient whatever it is asked (as Megatron's linear does)."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ASKED.append(("EagerLinear", ctx.needs_input_grad))
        return _linear_grads(ctx, grad, (True, True, ctx.has_bias))


def _linear_grads(ctx: Any, grad: torch.Tensor, want: tuple[bool, ...]) -> tuple[Any, ...]:
    x, w = ctx.saved_tensors
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return (grad @ w if want[0] else None, g2.t() @ x2 if want[1] else None, g2.sum(0) if want[2] else None)


class TwoOutputs(torch.autograd.Function):
    """Two outputs from one node (``x W^T`` and its square); only the first may be used downstream."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        y = x @ w.t()
        return y, y * y

    @staticmethod
    def backward(ctx: Any, g1: torch.Tensor, g2: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ASKED.append(("TwoOutputs", ctx.needs_input_grad))
        x, w = ctx.saved_tensors
        gy = g1 + 2 * (x @ w.t()) * g2  # g2 is zeros when the square is unused (materialized)
        gy2 = gy.reshape(-1, gy.shape[-1])
        return (gy @ w if ctx.needs_input_grad[0] else None,
                gy2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None)


class FnLinear(nn.Module):
    """Owns its weight and bias and runs them through ``fn`` (as Megatron's parallel linears do)."""

    def __init__(self, fn: type[torch.autograd.Function] = Linear, *, quantize: str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) * 0.4)
        self.bias = nn.Parameter(torch.randn(DIM) * 0.1)
        self.fn, self.quantize = fn, quantize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantize == "gemm":  # the parameter alone through a Function, then the routed GEMM
            return F.linear(x, Quantize.apply(self.weight), self.bias)
        if self.quantize == "fn":  # ... then into another Function, with the activation
            return self.fn.apply(x, Quantize.apply(self.weight), self.bias)
        return self.fn.apply(x, self.weight, self.bias)


class TwoHead(nn.Module):
    def __init__(self, *, both: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) * 0.4)
        self.both = both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, sq = TwoOutputs.apply(x, self.weight)
        return y + 0.1 * sq if self.both else y


class Stage(nn.Module):
    """Linear Function, tanh, quantized weight into the routed GEMM and into the Linear Function, a
    two-output Function, LayerNorm; ``ckpt`` wraps the middle."""

    def __init__(self, fn: type[torch.autograd.Function] = Linear, ckpt: Callable[..., Any] | None = None,
                 *, both: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.quant, self.qfn = FnLinear(fn), FnLinear(quantize="gemm"), FnLinear(fn, quantize="fn")
        self.two, self.norm, self.ckpt = TwoHead(both=both), nn.LayerNorm(DIM), ckpt

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        return self.two(self.qfn(self.quant(torch.tanh(self.first(h)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ckpt(self.middle, x) if self.ckpt is not None else self.middle(x)
        return self.norm(h)


CHECKPOINTS = {
    "none": None,
    "reentrant": functools.partial(checkpoint, use_reentrant=True),
    "non-reentrant": functools.partial(checkpoint, use_reentrant=False),
}


@pytest.fixture(autouse=True)
def _fresh_records() -> Iterator[None]:
    ASKED.clear()
    ALL_REDUCES.clear()
    yield


def _run_split(model: nn.Module, store: WeightGradStore, x: torch.Tensor, grad: torch.Tensor, key: Any = "u") -> torch.Tensor:
    with store.forward_of(key):
        out = model(x)
    with store.deferring(key):
        out.backward(grad)
    return out


def _assert_grads_match(model: nn.Module, reference: nn.Module, tol: float = TOL) -> None:
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=tol, msg=name)


def _in_b(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.grad is not None}


CHEAP = {"first.bias", "quant.bias", "qfn.bias", "norm.weight", "norm.bias"}


@pytest.mark.parametrize("both", [False, True], ids=["one-output-used", "both-used"])
@pytest.mark.parametrize("ckpt", CHECKPOINTS.values(), ids=CHECKPOINTS.keys())
def test_custom_functions_split_into_b_and_w_and_match_fused(ckpt: Callable[..., Any] | None, both: bool) -> None:
    model, store = Stage(Linear, ckpt, both=both), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(ROWS, DIM, generator=g, requires_grad=True), torch.randn(ROWS, DIM, generator=g)
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).backward(grad)
    ASKED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitBackwardWarning)
        _run_split(model, store, x, grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=TOL)
    assert _in_b(model) == CHEAP  # every 2-D weight waits for W
    # B asked the linears for the input and bias gradients only, the two-output node for the input's,
    # and never ran the quantizers (their consumers parked the gradients instead).
    assert _asked("Linear") == [(True, False, True)] * 2 and _asked("TwoOutputs") == [(True, False)]
    assert _asked("Quantize") == []
    ASKED.clear()
    store.run("u")
    assert _asked("Linear") == [(False, True, False)] * 2 and _asked("TwoOutputs") == [(False, True)]
    assert _asked("Quantize") == [(True,)] * 2
    assert store.pending() == [] and store.parked_bytes == 0
    _assert_grads_match(model, reference)


def test_a_function_computing_everything_anyway_runs_whole_in_b_and_warns_once_naming_it() -> None:
    model, store = Stage(EagerLinear), WeightGradStore()  # qfn too: an EagerLinear behind a quantizer
    reference = copy.deepcopy(model)
    enable_split_backward([model], store, root=model)
    x = torch.randn(ROWS, DIM)
    with pytest.warns(SplitBackwardWarning) as record:
        for mb in range(2):
            _run_split(model, store, x * (mb + 1), torch.ones(ROWS, DIM), key=mb)
    messages = [str(w.message) for w in record if issubclass(w.category, SplitBackwardWarning)]
    assert len(messages) == 1, messages  # two EagerLinear nodes per micro-batch, one warning in all
    assert "EagerLinear" in messages[0] and "qfn (" in messages[0] and "needs_input_grad" in messages[0]
    assert _in_b(model) == CHEAP | {"first.weight", "qfn.weight"}  # kept whole in B (qfn's through its quantizer)
    # Once per node and micro-batch, in B: qfn, then first (whose input, as on a first stage, needs no gradient).
    assert _asked("EagerLinear") == [(True, False, True), (False, False, True)] * 2
    ASKED.clear()
    store.run(0)
    store.run(1)
    assert _asked("EagerLinear") == [] and _asked("Quantize") == [(True,)] * 2  # only the routed GEMM's quantizer in W
    for mb in range(2):
        reference(x * (mb + 1)).backward(torch.ones(ROWS, DIM))
    _assert_grads_match(model, reference)


class Twice(nn.Module):
    """A tied weight: one parameter twice in one Function, and again through the routed GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) * 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = TwoWeights.apply(x, self.weight, self.weight)
        return F.linear(torch.tanh(h), self.weight)


class TwoWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, a, b)
        return x @ a.t() + torch.tanh(x) @ b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ASKED.append(("TwoWeights", ctx.needs_input_grad))
        x, a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx = g @ a + (g @ b.t()) * (1 - torch.tanh(x) ** 2) if need[0] else None
        return gx, g.t() @ x if need[1] else None, torch.tanh(x).t() @ g if need[2] else None


def test_a_tied_weight_is_counted_once_per_use() -> None:
    model, store = Twice(), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    x = torch.randn(ROWS, DIM)
    _run_split(model, store, x.clone().requires_grad_(True), torch.ones(ROWS, DIM))
    assert model.weight.grad is None and _asked("TwoWeights") == [(True, False, False)]
    store.run("u")
    reference(x.clone().requires_grad_(True)).backward(torch.ones(ROWS, DIM))
    _assert_grads_match(model, reference)


def test_w_keeps_the_saved_input_and_output_gradient_not_the_node() -> None:
    """The Function's saved input (the very storage autograd kept) and its output gradient wait
    for W; its node and the rest of the graph are freed by B."""
    layer, store = FnLinear(Linear), WeightGradStore()
    enable_split_backward([layer], store)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in layer.parameters()})
    x = torch.randn(ROWS, DIM, requires_grad=True)
    with meter.recording(), store.forward_of("u"):
        h = torch.tanh(x)
        out = layer(h)
    node = weakref.ref(out.grad_fn)
    unit = x.numel() * x.element_size()
    assert meter.live_bytes == unit  # tanh's output, saved by tanh and by the Function alike
    with store.deferring("u"):
        out.backward(torch.randn_like(out))
    del out, h
    gc.collect()
    assert node() is None and meter.live_bytes == 0
    assert store.parked_bytes == 2 * unit  # the Function's input and its output gradient
    store.run("u")
    assert store.parked_bytes == 0 and layer.weight.grad is not None


def test_a_function_applied_outside_any_module_is_found_at_the_start_of_b() -> None:
    """Its output is the unit's output, consumed by nothing routed: B's own call sorts it."""
    layer, store = FnLinear(Linear), WeightGradStore()
    reference = copy.deepcopy(layer)
    enable_split_backward([layer], store)
    x = torch.randn(ROWS, DIM, requires_grad=True)
    with store.forward_of("u"):
        out = Linear.apply(torch.tanh(x), layer.weight, layer.bias)
    with store.deferring("u"):
        torch.autograd.backward([out], [torch.ones_like(out)])
    assert layer.weight.grad is None and _asked("Linear") == [(True, False, True)]
    store.run("u")
    Linear.apply(torch.tanh(x), reference.weight, reference.bias).backward(torch.ones_like(out))
    _assert_grads_match(layer, reference)


class ScalesGradInPlace(Linear):
    """Honours ``needs_input_grad`` but scales its output gradient in place: W could not reuse it."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad.mul_(1.0)
        return _linear_grads(ctx, grad, ctx.needs_input_grad)


def test_an_output_gradient_modified_in_place_is_refused_not_reused() -> None:
    layer, store = FnLinear(ScalesGradInPlace), WeightGradStore()
    enable_split_backward([layer], store)
    with store.forward_of("u"):
        out = layer(torch.randn(ROWS, DIM, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"ScalesGradInPlace.*modified in place"), store.deferring("u"):
        out.backward(torch.ones(ROWS, DIM))


def test_fused_backward_and_plain_runs_leave_the_functions_as_they_are() -> None:
    model, store = Stage(Linear), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    x, grad = torch.randn(ROWS, DIM), torch.ones(ROWS, DIM)
    with store.forward_of("u"):
        out = model(x)
    with store.backward_of("u", defer=False):
        out.backward(grad)
    assert store.pending() == [] and _asked("Linear") == [(True, True, True), (False, True, True)]  # qfn, first
    model(x).backward(grad)  # outside any unit: plain autograd
    for _ in range(2):
        reference(x).backward(grad)
    _assert_grads_match(model, reference)


# ---- tensor parallel: a column/row pair whose backward all-reduces ---------------------------------
@pytest.fixture(scope="module")
def tp_group() -> Iterator[Any]:
    """A gloo group of one process: the all-reduces run for real (an identity over one rank)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def _all_reduce(t: torch.Tensor, group: Any, where: str) -> None:
    ALL_REDUCES.append(where)
    dist.all_reduce(t, group=group)


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the input gradient (a column-parallel layer's input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad = grad.clone()
        _all_reduce(grad, ctx.group, "copy")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (a row-parallel layer's output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        _all_reduce(out, group, "reduce")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad, None


class TPLinear(torch.autograd.Function):
    """Megatron-shaped linear: input, weight, bias, group, and whether to all-reduce the input gradient.

    ``mode``: "eager" computes every gradient and all-reduces the input's (Megatron's shape);
    "honest" computes what it is asked for, all-reducing only the input gradient it computes;
    "stubborn" computes what it is asked for but all-reduces on every call.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Any,  # type: ignore[override]
                reduce_dgrad: bool, mode: str) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.group, ctx.reduce_dgrad, ctx.mode, ctx.has_bias = group, reduce_dgrad, mode, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ASKED.append((f"TPLinear-{ctx.mode}", ctx.needs_input_grad))
        want = (True, True, ctx.has_bias) if ctx.mode == "eager" else ctx.needs_input_grad[:3]
        gx, gw, gb = _linear_grads(ctx, grad, want)
        if ctx.reduce_dgrad and (gx is not None or ctx.mode == "stubborn"):
            buf = gx if gx is not None else torch.zeros_like(grad @ ctx.saved_tensors[1])
            _all_reduce(buf, ctx.group, "dgrad")
        return gx, gw, gb, None, None, None


class ColumnRow(nn.Module):
    """A column-parallel linear (input gradient all-reduced) feeding a row-parallel one (output all-reduced)."""

    def __init__(self, group: Any, mode: str) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.w1, self.b1 = nn.Parameter(torch.randn(DIM, DIM) * 0.4), nn.Parameter(torch.randn(DIM) * 0.1)
        self.w2 = nn.Parameter(torch.randn(DIM, DIM) * 0.4)
        self.group, self.mode = group, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = TPLinear.apply(x, self.w1, self.b1, self.group, True, self.mode)  # column: all-reduce dgrad in backward
        h = torch.relu(h)
        return _ReduceFromTP.apply(TPLinear.apply(h, self.w2, None, self.group, False, self.mode), self.group)


def _needs(x: bool, w: bool, b: bool) -> tuple[bool, ...]:
    return (x, w, b, False, False, False)  # group, reduce_dgrad and mode need none


def _tp_backward_all_reduces(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> int:
    ALL_REDUCES.clear()
    model(x).backward(grad)
    return sum(1 for w in ALL_REDUCES if w != "reduce")


@pytest.mark.parametrize("mode", ["eager", "honest"])
def test_tensor_parallel_pair_runs_each_collective_once(tp_group: Any, mode: str) -> None:
    model, reference, store = ColumnRow(tp_group, mode), ColumnRow(tp_group, mode), WeightGradStore()
    enable_split_backward([model], store, root=model)
    x, grad = torch.randn(ROWS, DIM, requires_grad=True), torch.randn(ROWS, DIM)
    fused = _tp_backward_all_reduces(reference, x.detach().clone().requires_grad_(True), grad)
    assert fused == 1  # the column layer's input gradient
    ASKED.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with store.forward_of("u"):
            out = model(x)
        ALL_REDUCES.clear()
        with store.deferring("u"):
            out.backward(grad)
        in_b = [w for w in ALL_REDUCES if w != "reduce"]
        ALL_REDUCES.clear()
        store.run("u")
    assert len(in_b) == fused and ALL_REDUCES == []  # B ran it, W never again
    names = [str(w.message) for w in record if issubclass(w.category, SplitBackwardWarning)]
    if mode == "eager":  # computes both anyway: whole in B, named once
        assert len(names) == 1 and "TPLinear" in names[0], names
        assert _asked("TPLinear-eager") == [_needs(True, False, False), _needs(True, False, True)]
    else:  # B: the row layer (no bias), the column layer; W: both again, for their weights only
        assert names == [] and _asked("TPLinear-honest") == [_needs(True, False, False), _needs(True, False, True),
                                                             _needs(False, True, False), _needs(False, True, False)]
    _assert_grads_match(model, reference, tol=1e-5)


def test_a_collective_that_would_run_again_in_w_is_refused(tp_group: Any) -> None:
    model, store = ColumnRow(tp_group, "stubborn"), WeightGradStore()
    enable_split_backward([model], store)
    _run_split(model, store, torch.randn(ROWS, DIM, requires_grad=True), torch.ones(ROWS, DIM))
    ran = list(ALL_REDUCES)
    with pytest.raises(RuntimeError, match=r"TPLinear.*collective.*must not run twice"):
        store.run("u")
    assert [w for w in ALL_REDUCES[len(ran):] if w == "dgrad"] == ["dgrad"]  # counted by the Function, refused before running
