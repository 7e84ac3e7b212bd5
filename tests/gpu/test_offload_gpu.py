"""Activation offload on one CUDA device: real copy streams, exact gradients, device memory saved.

One rank's pass order (1F1B's rank 0 at p=4, m=8) runs a transformer-sized MLP block per unit,
as the engine drives ``Offloader``: without offload, then with every unit it can offload. The
gradients must be bit-identical and CUDA's peak allocation lower; the step-time overhead
against the memory saved is recorded (``record_property``, shown with ``-rA``), not asserted,
since timing thresholds would only measure the machine.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from ds_vshape.runtime.measuring.memory import ActivationMeter
from ds_vshape.runtime.offload.offloader import Offloader
from ds_vshape.schedules import Kind, Schedule
from ds_vshape.schedules.lowering import OpKind, lower

pytestmark = pytest.mark.gpu

ORDER = "0F0 0F1 0F2 0F3 0BW0 0F4 0BW1 0F5 0BW2 0F6 0BW3 0F7 0BW4 0BW5 0BW6 0BW7"
_KIND = {OpKind.FORWARD: Kind.F, OpKind.BACKWARD: Kind.BW}
HIDDEN, TOKENS = 2048, 4096


def _step(model: nn.Module, xs: list[torch.Tensor], share: float, steps: int = 3) -> tuple[list[torch.Tensor], int, float]:
    """Train ``steps`` steps in ORDER; returns the last step's grads, CUDA's peak bytes and seconds."""
    device = xs[0].device
    schedule = Schedule.from_text([ORDER], name="1f1b-rank0", micro_batches=8, stage_to_rank=[0])
    ops = [op for op in lower(schedule, 0) if op.kind in _KIND]
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    off = Offloader(meter, share=share, device=device, rank=0)
    seconds = 0.0
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        for x in xs:
            x.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        off.start_step(schedule, ops, train=True)
        outs = {}
        for op in ops:
            unit, mb = (op.stage, op.micro_batch, op.seq_chunk), op.micro_batch
            off.before_pass(_KIND[op.kind], unit)
            if op.kind is OpKind.FORWARD:
                with off.forward(unit, [xs[mb]], measure=False):
                    out = model(xs[mb])
                off.after_forward(unit, [xs[mb], out])
                outs[mb] = out
            else:
                outs.pop(mb).float().pow(2).mean().backward()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone() for x in xs]
    return grads, torch.cuda.max_memory_allocated(device), seconds


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN)]
    return nn.Sequential(*layers).to(device)


def test_offload_on_a_copy_stream_is_exact_and_saves_device_memory(record_property: pytest.RecordProperty) -> None:
    device = torch.device("cuda", 0)
    g = torch.Generator(device="cpu").manual_seed(1)
    xs = [torch.randn(TOKENS, HIDDEN, generator=g).to(device).requires_grad_() for _ in range(8)]
    plain, plain_peak, plain_s = _step(_model(device), xs, 0.0)
    moved, moved_peak, moved_s = _step(_model(device), xs, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, moved))
    assert moved_peak < plain_peak, (moved_peak, plain_peak)
    record_property("peak_bytes", {"plain": plain_peak, "offload": moved_peak, "ratio": moved_peak / plain_peak})
    record_property("step_s", {"plain": plain_s, "offload": moved_s, "overhead": moved_s / plain_s - 1})
