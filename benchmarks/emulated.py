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
(2 units) of 1 + extra saved units until W: with ``extra=3`` that is half, a ``w_memory`` of 0.5.

``DEVICE`` counts the time slept per kind (F, B, W) in this process, so a run can check
that every system did the same emulated work per rank.

Asynchronous mode (``DEVICE.attach(AsyncDevice(...))``, see ``async_device.py``): the same
three places *enqueue* their pass on the rank's device stream instead of sleeping, and the
host runs on. The layer then also marks what it hands on: its output (forward) and its
input's gradient (backward) are published as ready when the stream gets there, and its
input (forward) and output gradient (backward) are looked up, so a tensor that came from
another rank makes the stream wait for its transfer. Without an attached device none of
this runs and the sync mode is what it always was.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from benchmarks.async_device import AsyncDevice

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
        self.async_device: AsyncDevice | None = None  # set: passes are enqueued, not slept

    def attach(self, device: AsyncDevice | None) -> None:
        """Run passes on ``device``'s stream from now on (None: back to sleeping on the host)."""
        self.async_device = device

    def produced(self, t: torch.Tensor) -> None:
        if self.async_device is not None:
            self.async_device.produced(t)

    def consumed(self, t: torch.Tensor) -> None:
        if self.async_device is not None:
            self.async_device.consumed(t)

    def synchronize(self) -> None:
        """The host waits for the device (a no-op when the host itself did the passes)."""
        if self.async_device is not None:
            self.async_device.synchronize()

    def sleep(self, seconds: float, kind: str) -> None:
        """Take ``seconds`` of wall time, as a kernel would: no CPU while waiting.

        ``time.sleep`` wakes up late (about 0.1-0.3 ms here), which would make every pass
        2-3 % longer than asked. So it sleeps for the time minus its estimated lateness
        and spins the last few hundred microseconds to the deadline.
        """
        if seconds <= 0:
            return
        if self.async_device is not None:
            # The device runs the pass for exactly its time (it plans deadlines): count it as done.
            self.async_device.run(seconds, kind)
            self.slept[kind] += seconds
            self.asked[kind] += seconds
            self.count[kind] += 1
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
        out = y.clone()
        DEVICE.produced(out)  # the layer's output may be sent to the next rank
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        DEVICE.consumed(grad)  # an output gradient received from the next rank
        DEVICE.sleep(ctx.t_b, "B")
        return grad, None, None, None


class _Boundary(torch.autograd.Function):
    """Identity on the layer input (async mode only): a received input waits for its transfer
    on the device; the input's gradient, leaving B, is published for the previous rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        DEVICE.consumed(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Autograd runs a layer's weight-gradient nodes before this one (accumulate nodes
        # first), so in a fused backward the ready time already includes W, as on a GPU
        # where the send of this gradient waits for everything enqueued before it.
        DEVICE.produced(grad)
        return grad


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
        if DEVICE.async_device is not None:
            x = _Boundary.apply(x)
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
