"""Split backward for every kind of parameter: gradients appear at W, not at B, and equal a fused backward's.

One stage mixes what real models hold: Linear, LayerNorm, Embedding, GPT-2's Conv1D, a custom
parameter used through ``torch.matmul``, a head tied to the embedding via ``F.linear``, a frozen
Linear. Each test runs it as the engine does (forward under ``forward_of``, B under
``deferring``, W by ``run``) beside a deep copy trained with a plain backward. By default the
cheap parameters (at most one dimension: norm scales, biases) get their gradients in B.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.pytorch_utils import Conv1D

import warnings
from contextlib import contextmanager
from typing import Iterator

from ds_vshape.runtime.measuring.memory import ActivationMeter
from ds_vshape.runtime.split.split_backward import SplitBackwardWarning, WeightGradStore, enable_split_backward

DIM, VOCAB, ROWS, SEQ = 8, 11, 2, 3
TOL = 1e-6


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) * 0.3)
        self.scale = nn.Parameter(torch.rand(DIM) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.w) * self.scale


class Stage(nn.Module):
    """``ckpt`` wraps the middle (fc, norm, conv) in a checkpoint function."""

    def __init__(self, ckpt: Callable[..., Any] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.conv = Conv1D(DIM, DIM)
        nn.init.normal_(self.conv.bias, std=0.1)
        self.custom = Custom()
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.ckpt = ckpt

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(self.norm(self.fc(h))))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = x + self.embed(ids)
        h = self.ckpt(self.middle, h) if self.ckpt is not None else self.middle(h)
        h = self.frozen(self.custom(h))
        return F.linear(h, self.embed.weight)  # the head tied to the embedding


CHECKPOINTS = {
    "none": None,
    "reentrant": functools.partial(checkpoint, use_reentrant=True),
    "non-reentrant": functools.partial(checkpoint, use_reentrant=False),
}


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, SEQ, DIM, generator=g)
    return x, torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), torch.randn(ROWS, SEQ, VOCAB, generator=g)


@contextmanager
def _no_split_warning() -> Iterator[None]:
    """Cheap gradients computed in B are by design: no SplitBackwardWarning for them."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitBackwardWarning)
        yield


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("cheap_in_b", [True, False], ids=["cheap-in-b", "all-in-w"])
@pytest.mark.parametrize("ckpt", CHECKPOINTS.values(), ids=CHECKPOINTS.keys())
def test_weight_gradients_wait_for_w_and_match_fused(ckpt: Callable[..., Any] | None, cheap_in_b: bool) -> None:
    model, store = Stage(ckpt), WeightGradStore(cheap_in_b=cheap_in_b)
    reference = copy.deepcopy(model)
    assert enable_split_backward([model], store) == 6  # embed, fc, norm, conv, custom, frozen
    x, ids, grad = _inputs()
    x_ref = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    reference(x_ref, ids).backward(grad)
    with store.forward_of("u"):
        out = model(x, ids)
    with _no_split_warning(), store.deferring("u"):
        out.backward(grad)
    in_b = {n for n, p in model.named_parameters() if p.grad is not None}
    cheap = {n for n, p in _trainable(model).items() if p.dim() <= 1}
    assert cheap == {"fc.bias", "norm.weight", "norm.bias", "conv.bias", "custom.scale"}
    assert in_b == (cheap if cheap_in_b else set()), in_b
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=TOL)
    assert store.pending() == ["u"] and store.parked_bytes > 0
    store.run("u")
    assert store.pending() == [] and store.parked_bytes == 0
    expected = _trainable(reference)
    assert _trainable(model).keys() == expected.keys() and "embed.weight" in expected
    for name, param in _trainable(model).items():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=0, atol=TOL, msg=name)
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None


def test_w_accumulates_over_micro_batches_and_runs_accumulate_hooks() -> None:
    model, store = Stage(), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    fired: list[str] = []
    for name, param in _trainable(model).items():
        # Autograd also calls it, with .grad untouched, for the None that B returns: count real ones.
        param.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name) if p.grad is not None else None)
    x, ids, grad = _inputs()
    for mb in range(2):
        with store.forward_of(mb):
            out = model(x * (mb + 1), ids)
        with store.deferring(mb):
            out.backward(grad)
        reference(x * (mb + 1), ids).backward(grad)
    assert set(fired) == {n for n, p in _trainable(model).items() if p.dim() <= 1}  # only the cheap ones in B
    fired.clear()
    store.run(1)
    store.run(0)
    assert set(fired) == {n for n, p in _trainable(model).items() if p.dim() > 1}
    expected = _trainable(reference)
    for name, param in _trainable(model).items():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=0, atol=TOL, msg=name)


def test_fused_backward_under_the_store_computes_everything_at_once() -> None:
    model, store = Stage(CHECKPOINTS["non-reentrant"]), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    x, ids, grad = _inputs()
    with store.forward_of("u"):
        out = model(x, ids)
    with store.backward_of("u", defer=False):
        out.backward(grad)
    reference(x, ids).backward(grad)
    assert store.pending() == []
    expected = _trainable(reference)
    for name, param in _trainable(model).items():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=0, atol=TOL, msg=name)


def test_frozen_parameters_park_nothing() -> None:
    layer, store = nn.Linear(DIM, DIM).requires_grad_(False), WeightGradStore()
    enable_split_backward([layer], store)
    x = torch.randn(ROWS, DIM, requires_grad=True)
    with store.forward_of("u"):
        out = torch.nn.functional.layer_norm(layer(x), (DIM,))
    with store.deferring("u"):
        out.sum().backward()
    assert store.pending() == [] and store.parked_bytes == 0 and x.grad is not None


@pytest.mark.parametrize("cheap_in_b", [True, False], ids=["cheap-in-b", "all-in-w"])
def test_parked_bytes_match_what_w_needs(cheap_in_b: bool) -> None:
    """Linear parks its input and output gradient; LayerNorm, unless B computes its (cheap)
    gradients, its input, statistics and output gradient."""
    fc, norm, store = nn.Linear(DIM, DIM), nn.LayerNorm(DIM), WeightGradStore(cheap_in_b=cheap_in_b)
    enable_split_backward([fc, norm], store)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in [*fc.parameters(), *norm.parameters()]})
    x = torch.randn(ROWS * SEQ, DIM, requires_grad=True)
    with meter.recording(), store.forward_of("u"):
        out = norm(fc(x))
    unit = x.numel() * x.element_size()
    stats = 2 * ROWS * SEQ * x.element_size()  # mean and rstd
    # x (fc) and fc's output (norm); a re-run norm computes its statistics in B, autograd's saves them.
    assert meter.live_bytes == 2 * unit + (stats if cheap_in_b else 0)
    with store.deferring("u"):
        out.backward(torch.randn_like(out))
    if cheap_in_b:
        assert store.parked_bytes == 2 * unit  # x (the tensor autograd saved) and fc's output gradient
    else:
        assert store.parked_bytes == 4 * unit + stats  # x, fc's output gradient, norm's input, norm's output gradient
    store.run("u")
    assert store.parked_bytes == 0


class InPlaceScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(ROWS, DIM))  # two dimensions: not cheap, meant for W

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).mul_(self.scale)


def test_a_gradient_left_in_b_warns_once_naming_the_module() -> None:
    model = nn.Sequential(nn.Linear(DIM, DIM), InPlaceScale())
    reference, store = copy.deepcopy(model), WeightGradStore()
    enable_split_backward([model], store, root=model)
    x = torch.randn(ROWS, DIM)
    with pytest.warns(SplitBackwardWarning) as record:
        for mb in range(2):
            with store.forward_of(mb):
                out = model(x)
            with store.deferring(mb):
                out.sum().backward()
    messages = [str(w.message) for w in record if issubclass(w.category, SplitBackwardWarning)]
    assert len(messages) == 1 and "1 (" in messages[0] and "InPlaceScale" in messages[0]
    assert model[0].weight.grad is None  # the linear still waits for W
    store.run(0)
    store.run(1)
    for _ in range(2):
        reference(x).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=TOL)


def test_tied_head_through_a_transposed_weight_defers_too() -> None:
    """``x @ w.t()`` (the test worker's tied head): the transpose is computed from the parameter alone."""
    embed, store = nn.Embedding(VOCAB, DIM), WeightGradStore()
    enable_split_backward([embed], store)
    reference = copy.deepcopy(embed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ))
    with store.forward_of("u"):
        out = embed(ids) @ embed.weight.t()
    with store.deferring("u"):
        out.sum().backward()
    assert embed.weight.grad is None
    store.run("u")
    (reference(ids) @ reference.weight.t()).sum().backward()
    torch.testing.assert_close(embed.weight.grad, reference.weight.grad, rtol=0, atol=TOL)


def test_outside_the_contexts_the_model_runs_untouched() -> None:
    model, store = Stage(), WeightGradStore()
    reference = copy.deepcopy(model)
    enable_split_backward([model], store)
    x, ids, grad = _inputs()
    model(x, ids).backward(grad)  # no forward_of: plain autograd, gradients at once
    reference(x, ids).backward(grad)
    for (name, got), want in zip(_trainable(model).items(), _trainable(reference).values()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0, msg=name)
