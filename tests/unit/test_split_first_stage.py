"""Split backward on a first stage (its input needs no gradient) behind custom autograd Functions.

The bug these pin (found by the 3D tests): a stage whose input needs no gradient (data, or
token ids into an embedding), holding a custom Function (a tensor-parallel all-reduce, here an
identity) whose output is added to a residual, failed in W with "Trying to backward through
the graph a second time". ``split_graph`` looked through ds_vshape's own GEMM node for the
input of ``fc(x)`` and, the data having no gradient edge, took ``fc(x)`` for a parameter-only
tensor: the Function became "derived", the residual add parked a W that backwarded through
the GEMM node B had freed. Each test runs B and W as the engine does beside a deep copy
trained with a plain backward (fp32, exact within 1e-5) and checks the weight gradient was
really deferred (none after B).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward

DIM, ROWS, VOCAB = 8, 4, 11
TOL = 1e-5


class _Identity(torch.autograd.Function):
    """A tensor-parallel all-reduce of one process: the output is the input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


class _Linear(torch.autograd.Function):
    """y = x W^T, computing each gradient only where ``ctx.needs_input_grad`` asks for it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return x.matmul(weight.t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class IdentityResidual(nn.Module):
    """``Identity(fc(x)) + x``: the minimal reproduction."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Identity.apply(self.fc(x)) + x


class LinearFnResidual(nn.Module):
    """``h = fc(x); LinearFn(h, W) + h``: a parameter-taking Function behind a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.tanh(_Linear.apply(h, self.weight) + h)


class EmbeddingResidual(nn.Module):
    """Token ids into an embedding, reduced by a Function (Megatron's vocab-parallel embedding), then a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = _Identity.apply(self.emb(ids))
        return self.fc(h) + h


class NormFirst(nn.Module):
    """A norm on the data (a native node mixing a constant and a cheap parameter) before the Function."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Identity.apply(self.norm(x))
        return F.gelu(self.fc(h)) + h


def _data(model: nn.Module, needs_grad: bool) -> torch.Tensor:
    if isinstance(model, EmbeddingResidual):
        return torch.randint(0, VOCAB, (ROWS,))
    return torch.randn(ROWS, DIM, requires_grad=needs_grad)


def _deferred(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dim() > 1]


MODELS: list[Callable[[], nn.Module]] = [IdentityResidual, LinearFnResidual, EmbeddingResidual, NormFirst]


@pytest.mark.parametrize("input_needs_grad", [False, True], ids=["first-stage", "later-stage"])
@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
def test_a_stage_behind_a_custom_function_splits_and_matches_fused(make: Callable[[], nn.Module],
                                                                    input_needs_grad: bool) -> None:
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    store = WeightGradStore()
    enable_split_backward([model], store)
    x = _data(model, input_needs_grad)
    x_ref = x.detach().clone().requires_grad_(x.requires_grad)
    grad = torch.randn(ROWS, DIM)

    with store.forward_of("u"):
        out = model(x)
    with store.deferring("u"):
        out.backward(grad)
    params = dict(model.named_parameters())
    assert all(params[n].grad is None for n in _deferred(model)), "a weight gradient was not deferred to W"
    store.run("u")
    assert store.pending() == []
    reference(x_ref).backward(grad)

    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=TOL, msg=name)
    if input_needs_grad:
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=TOL)
