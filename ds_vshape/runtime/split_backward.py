"""Split backward: B computes input gradients now, W computes weight gradients later.

Linear layers carry almost all of a transformer's weight-gradient FLOPs, so their dW GEMM
is what is worth delaying. While a unit's B runs, each linear layer computes only its input
gradient and parks (input, output-gradient) in the store under the unit's key; the unit's W
then runs the parked GEMMs. Every other parametered module (norms, embeddings, biases of
custom layers) gets its gradient during B from ordinary autograd: exact, just not delayed.

W accumulates through ``Tensor.backward`` on the leaf, so DeepSpeed's post-accumulate
hooks (bf16 optimizer, ZeRO) see the gradient exactly as if autograd had produced it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from contextlib import contextmanager
from types import MethodType
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WeightGradStore", "enable_split_backward"]


class WeightGradStore:
    """Parked weight-gradient work, keyed by unit (stage, micro-batch, chunk)."""

    def __init__(self) -> None:
        self._current: Hashable | None = None  # unit whose forward is running
        self._deferring: set[Hashable] = set()
        self._parked: dict[Hashable, list[tuple[nn.Linear, torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self._refs: dict[int, int] = {}  # storage -> parked references (q, k, v share one input)
        self.parked_bytes = 0

    @contextmanager
    def forward_of(self, key: Hashable) -> Iterator[None]:
        """Tag the linear layers run inside with ``key``."""
        previous, self._current = self._current, key
        try:
            yield
        finally:
            self._current = previous

    @contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Inside, the backward of ``key``'s linear layers parks its weight GEMMs."""
        self._deferring.add(key)
        try:
            yield
        finally:
            self._deferring.discard(key)

    def park(self, key: Hashable, module: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        self._parked[key].append((module, x, grad_out))
        for t in (x, grad_out):
            self._hold(t, +1)

    def _hold(self, t: torch.Tensor, delta: int) -> None:
        """Count each parked storage once, however many layers park it."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        before = self._refs.get(ptr, 0)
        after = before + delta
        if before == 0:
            self.parked_bytes += storage.nbytes()
        if after == 0:
            self.parked_bytes -= storage.nbytes()
            self._refs.pop(ptr, None)
        else:
            self._refs[ptr] = after

    def is_deferring(self, key: Hashable) -> bool:
        return key in self._deferring

    def run(self, key: Hashable) -> None:
        """The W pass of ``key``: every parked weight GEMM, accumulated into ``.grad``."""
        for module, x, grad_out in self._parked.pop(key, []):
            _accumulate_weight_grads(module, x, grad_out)
            for t in (x, grad_out):
                self._hold(t, -1)

    def pending(self) -> list[Hashable]:
        return list(self._parked)

    def clear(self) -> None:
        """Drop all parked work: after a skipped fp16 step nothing may carry into the next."""
        self._parked.clear()
        self._refs.clear()
        self.parked_bytes = 0

    @property
    def current(self) -> Hashable | None:
        return self._current


def _accumulate_weight_grads(module: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor) -> None:
    x2 = x.reshape(-1, x.shape[-1])
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    leaves, grads = [], []
    if module.weight.requires_grad:
        leaves.append(module.weight)
        grads.append(g2.t().matmul(x2).to(module.weight.dtype))
    if module.bias is not None and module.bias.requires_grad:
        leaves.append(module.bias)
        grads.append(g2.sum(0).to(module.bias.dtype))
    if leaves:
        torch.autograd.backward(leaves, grads)


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, module: nn.Linear, store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.store, ctx.key = module, store, store.current
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        if ctx.key is not None and ctx.store.is_deferring(ctx.key):
            ctx.store.park(ctx.key, ctx.module, x.detach(), grad_out.detach())
            return grad_x, None, None, None, None
        g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_w = g2.t().matmul(x2) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def _split_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    store: WeightGradStore = self._ds_vshape_store  # type: ignore[attr-defined]
    if store.current is None or not torch.is_grad_enabled():
        return F.linear(x, self.weight, self.bias)
    return _SplitLinear.apply(x, self.weight, self.bias, self, store)


def enable_split_backward(modules: list[nn.Module], store: WeightGradStore) -> int:
    """Route every ``nn.Linear`` inside ``modules`` through the store; returns how many."""
    count = 0
    for root in modules:
        for mod in root.modules():
            if type(mod) is nn.Linear and not hasattr(mod, "_ds_vshape_store"):
                mod._ds_vshape_store = store  # type: ignore[attr-defined]
                mod.forward = MethodType(_split_linear_forward, mod)  # type: ignore[method-assign]
                count += 1
    return count
