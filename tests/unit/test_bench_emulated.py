"""The benchmark's emulated layer: right gradients in every backward path, work in the right pass.

No timing assertions: the sleeps are set to zero where only gradients matter, and where
the pass matters the test checks *which* pass slept (counts), never how long.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.emulated import DEVICE, EmuLayer, make_layers
from ds_vshape.runtime.memory import ActivationMeter
from ds_vshape.runtime.split_backward import WeightGradStore, enable_split_backward

DIM, ROWS = 8, 4


def _reference(layers: list[EmuLayer]) -> nn.Sequential:
    """The same weights as plain linear layers (the emulated layer is a linear map)."""
    out = []
    for layer in layers:
        lin = nn.Linear(DIM, DIM)
        lin.load_state_dict(layer.fc.state_dict())
        out.append(lin)
    return nn.Sequential(*out)


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("mode", ["linear", "graph"])
def test_fused_backward_matches_plain_linear(mode: str) -> None:
    layers = make_layers(3, DIM, 0.0, 0.0, 0.0, mode=mode, seed=1)
    model, ref = nn.Sequential(*layers), _reference(layers)
    x = torch.randn(ROWS, DIM, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    model(x).pow(2).sum().backward()
    ref(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for got, want in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, want)


def test_split_backward_under_ds_vshape_store_matches_and_defers_w() -> None:
    """ds_vshape's split linear: B gives the input gradient, W (later) the weight gradients."""
    layers = make_layers(2, DIM, 0.0, 1e-6, 1e-6, mode="linear", seed=2)
    model, ref = nn.Sequential(*layers), _reference(layers)
    store = WeightGradStore()
    assert enable_split_backward([model], store) == 2
    x = torch.randn(ROWS, DIM, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with store.forward_of("u"):
        out = model(x)
    DEVICE.reset()
    with store.deferring("u"):
        out.pow(2).sum().backward()
    assert DEVICE.count.get("B") == 2 and "W" not in DEVICE.count  # B ran, W parked
    assert all(layer.fc.weight.grad is None for layer in layers)
    store.run("u")
    assert DEVICE.count.get("W") == 2  # the accumulate hook fired once per layer at W
    ref(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for got, want in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, want)


def test_graph_mode_weight_pass_runs_in_weight_grad_only() -> None:
    """torch.distributed.pipelining's split: grad w.r.t. inputs first, weights later."""
    layers = make_layers(2, DIM, 0.0, 1e-6, 1e-6, mode="graph", seed=3)
    model, ref = nn.Sequential(*layers), _reference(layers)
    x = torch.randn(ROWS, DIM, requires_grad=True)
    out = model(x).pow(2).sum()
    DEVICE.reset()
    (gx,) = torch.autograd.grad(out, [x], retain_graph=True)
    assert DEVICE.count.get("B") == 2 and "W" not in DEVICE.count
    weights = [p for p in model.parameters()]
    gw = torch.autograd.grad(out, weights)
    assert DEVICE.count.get("W") == 2
    x_ref = x.detach().clone().requires_grad_(True)
    ref(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(gx, x_ref.grad)
    for got, want in zip(gw, _grads(ref)):
        torch.testing.assert_close(got, want)


def test_each_pass_sleeps_once_per_layer_in_fused_backward() -> None:
    layers = make_layers(3, DIM, 1e-6, 1e-6, 1e-6, mode="linear", seed=4)
    model = nn.Sequential(*layers)
    DEVICE.reset()
    model(torch.randn(ROWS, DIM)).sum().backward()
    assert dict(DEVICE.count) == {"F": 3, "B": 3, "W": 3}


def test_split_backward_parks_half_of_the_saved_activation() -> None:
    """extra=3: x + grad_out parked of x + 3x saved, i.e. ds_vshape's default w_memory 0.5."""
    layer = EmuLayer(DIM, 0.0, 0.0, 0.0, seed=5)
    store = WeightGradStore()
    enable_split_backward([layer], store)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in layer.parameters()})
    x = torch.randn(ROWS, DIM, requires_grad=True)
    with meter.recording(), store.forward_of("u"):
        out = layer(x)
    saved = meter.live_bytes
    assert saved == 4 * x.numel() * x.element_size()
    with store.deferring("u"):
        out.backward(torch.randn_like(out))  # a real output gradient, as the engine receives one
    assert store.parked_bytes / saved == pytest.approx(0.5)
