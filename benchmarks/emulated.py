"""An emulated accelerator: layers whose passes take a fixed wall time without using the CPU.

A GPU kernel keeps the host thread free while it runs; ``time.sleep`` does the same for a
CPU process, so several pipeline ranks on a 2-core machine do not compete for cores while
their "device" is busy. Real (tiny) tensors still flow and real gradients are produced, so
any pipeline system can train this model and the step time it reaches reflects its schedule
and its own overhead, not CPU contention.

Each ``EmuLayer`` is a small linear layer plus three sleeps:

* F sleeps ``t_f`` in the forward (inside ``_Pass.forward``, after the linear);
* B sleeps ``t_b`` when the input gradient flows back through ``_Pass.backward``;
  ``_Pass`` sits on the layer's output, so autograd reaches it even when the stage input
  needs no gradient (first stage);
* W sleeps ``t_w`` when the weight gradient is produced. Two ways, by ``mode``:

  - ``"linear"``: the layer holds a real ``nn.Linear`` (so ds_vshape's split backward
    parks its weight GEMM until W) and the sleep is a post-accumulate-grad hook on its
    weight. It fires when the weight gradient lands in ``.grad``: at W under split
    backward (W runs ``Tensor.backward`` on the leaf), inside the fused backward otherwise.
    Used for ds_vshape and DeepSpeed.
  - ``"graph"``: the weight goes through ``_WeightPass`` whose backward sleeps; the sleep
    then runs wherever autograd computes the weight gradient. This is what
    ``torch.distributed.pipelining``'s split backward needs: its W calls
    ``torch.autograd.grad`` on the weights and adds to ``.grad`` by hand, so no
    accumulate hook would fire.

Activation memory: the linear saves its input ``x``; ``_Pass`` also saves a buffer of
``extra`` times the size of ``x`` that stands for the layer's other intermediates
(attention scores, MLP activations). Split backward keeps ``x`` and the output gradient
(2 units) of 1 + extra saved units until W: with ``extra=3`` that is half, ds_vshape's
default ``w_memory``.

``DEVICE`` counts the time slept per kind (F, B, W) in this process, so a run can check
that every system did the same emulated work per rank.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DEVICE", "EmuLayer", "DeviceClock", "excluded_from_meter", "make_layers", "metered_loss"]


class DeviceClock:
    """Accumulates emulated device time per kind; ``sleep`` is the device doing a pass."""

    # Spin at most this long to hit the deadline exactly: a fraction of a percent of CPU.
    MAX_SPIN_S = 0.0003

    def __init__(self) -> None:
        self.slept: dict[str, float] = defaultdict(float)
        self.asked: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.wake_late_s = 0.0002  # running estimate of how late time.sleep wakes up

    def sleep(self, seconds: float, kind: str) -> None:
        """Take ``seconds`` of wall time, as a kernel would: no CPU while waiting.

        ``time.sleep`` wakes up late (about 0.1-0.3 ms here), which would make every pass
        2-3 % longer than asked. So it sleeps for the time minus its estimated lateness
        and spins the last few hundred microseconds to the deadline.
        """
        if seconds <= 0:
            return
        start = time.perf_counter()
        deadline = start + seconds
        nap = seconds - self.wake_late_s - self.MAX_SPIN_S / 2
        if nap > 0:
            time.sleep(nap)
            late = time.perf_counter() - (start + nap)
            self.wake_late_s = min(0.9 * self.wake_late_s + 0.1 * late, 0.002)
        while time.perf_counter() < deadline:
            pass
        self.slept[kind] += time.perf_counter() - start
        self.asked[kind] += seconds
        self.count[kind] += 1

    def reset(self) -> None:
        self.slept.clear()
        self.asked.clear()
        self.count.clear()

    def snapshot(self) -> dict[str, Any]:
        return {"slept_s": dict(self.slept), "asked_s": dict(self.asked), "count": dict(self.count)}


DEVICE = DeviceClock()


class _Pass(torch.autograd.Function):
    """Identity whose forward takes ``t_f`` and whose backward takes ``t_b``."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, t_f: float, t_b: float, extra_numel: int) -> torch.Tensor:  # type: ignore[override]
        DEVICE.sleep(t_f, "F")
        ctx.t_b = t_b
        if extra_numel > 0:
            # Stands for the layer's other saved intermediates; freed when B has run.
            ctx.save_for_backward(torch.zeros(extra_numel, dtype=y.dtype, device=y.device))
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        DEVICE.sleep(ctx.t_b, "B")
        return grad, None, None, None


class _WeightPass(torch.autograd.Function):
    """Identity on a weight whose backward takes ``t_w`` (mode "graph")."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, t_w: float) -> torch.Tensor:  # type: ignore[override]
        ctx.t_w = t_w
        return weight.view_as(weight)  # a view: the activation meter sees a parameter, not an activation

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        DEVICE.sleep(ctx.t_w, "W")
        return grad, None


class EmuLayer(nn.Module):
    """``dim -> dim`` linear layer whose F, B and W passes take ``t_f``, ``t_b``, ``t_w`` seconds."""

    def __init__(self, dim: int, t_f: float, t_b: float, t_w: float, *, mode: str = "linear", extra: int = 3, seed: int | None = None) -> None:
        super().__init__()
        if mode not in ("linear", "graph"):
            raise ValueError(f"mode must be 'linear' or 'graph', got {mode!r}")
        if seed is not None:
            torch.manual_seed(seed)
        self.fc = nn.Linear(dim, dim)
        with torch.no_grad():
            self.fc.weight.mul_(0.5)  # keeps activations bounded through many layers
        self.t_f, self.t_b, self.t_w, self.mode, self.extra = t_f, t_b, t_w, mode, extra
        if mode == "linear":
            self.fc.weight.register_hook(_w_hook(t_w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "linear":
            y = self.fc(x)  # ds_vshape swaps this module's forward for its split linear
        else:
            y = F.linear(x, _WeightPass.apply(self.fc.weight, self.t_w), self.fc.bias)
        return _Pass.apply(y, self.t_f, self.t_b, self.extra * x.numel())


def _w_hook(t_w: float) -> Callable[[torch.Tensor | None], None]:
    def hook(grad: torch.Tensor | None) -> None:
        # Autograd also calls leaf hooks with no gradient, e.g. when ds_vshape's B returns
        # None for a parked weight; only a delivered gradient is weight-gradient work.
        if grad is not None:
            DEVICE.sleep(t_w, "W")

    return hook


def make_layers(num_layers: int, dim: int, t_f: float, t_b: float, t_w: float, *, mode: str = "linear", seed: int = 0) -> list[EmuLayer]:
    return [EmuLayer(dim, t_f, t_b, t_w, mode=mode, seed=seed + i) for i in range(num_layers)]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@contextmanager
def excluded_from_meter() -> Iterator[None]:
    """Inner saved-tensor hooks win: tensors saved in here bypass any activation meter."""
    with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
        yield


def metered_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` with its saved tensors kept out of the activation meters.

    ds_vshape computes the loss outside its meter; DeepSpeed computes it inside the forward
    instruction we meter. Wrapping the loss makes every system count the same tensors.
    """

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        with excluded_from_meter():
            return loss_fn(*args, **kwargs)

    wrapped.__name__ = getattr(loss_fn, "__name__", "loss")
    return wrapped


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()
