"""A known split-backward bug (found by the 3D tests): a first stage behind a custom Function.

A stage whose input needs no gradient (the first stage: data, or token ids into an
embedding), holding a custom autograd Function (a tensor-parallel all-reduce, here an
identity) whose output is added to a residual, fails in W with "Trying to backward through
the graph a second time". With an input that needs a gradient, or without the residual, it
passes. Megatron layers on the first stage of a split-backward schedule that does not fuse
the first stage's B and W (v-half, v-zb, v-min, ...) hit this. Strict xfail: it flags the fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Identity.apply(self.fc(x)) + x


def _split_step(input_needs_grad: bool) -> None:
    torch.manual_seed(0)
    stage, store = _Residual(), WeightGradStore()
    enable_split_backward([stage], store)
    x = torch.randn(4, 8, requires_grad=input_needs_grad)
    with store.forward_of("u"):
        out = stage(x)
    with store.deferring("u"):
        out.backward(torch.ones_like(out))
    store.run("u")
    assert stage.fc.weight.grad is not None


def test_a_later_stage_behind_a_custom_function_splits() -> None:
    _split_step(input_needs_grad=True)


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="split_graph: first stage, custom Function, residual")
def test_a_first_stage_behind_a_custom_function_splits() -> None:
    _split_step(input_needs_grad=False)
