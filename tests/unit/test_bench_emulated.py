"""The benchmark's emulated layer: right gradients in every backward path, work in the right pass.

No timing assertions: the sleeps are set to zero where only gradients matter, and where
the pass matters the test checks *which* pass slept (counts), never how long. The
asynchronous device's tests check order (which pass ran first, whether the host got
back before a pass ended) and the planned times, which are arithmetic, not measured.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.async_device import AsyncDevice, DeviceStream, ReadyTable, TransferModel, tensor_key
from benchmarks.emulated import DEVICE, EmuLayer, make_layers
from ds_vshape.runtime.measuring.memory import ActivationMeter
from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward

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


def test_graph_mode_under_ds_vshape_store_defers_the_weight_pass_to_w() -> None:
    """The weight through a custom Function (``_WeightPass``): ds_vshape's W, not its B, runs it."""
    layers = make_layers(2, DIM, 0.0, 1e-6, 1e-6, mode="graph", seed=2)
    model, ref = nn.Sequential(*layers), _reference(layers)
    store = WeightGradStore()
    enable_split_backward([model], store)
    x = torch.randn(ROWS, DIM, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with store.forward_of("u"):
        out = model(x)
    DEVICE.reset()
    with store.deferring("u"):
        out.pow(2).sum().backward()
    assert DEVICE.count.get("B") == 2 and "W" not in DEVICE.count
    assert all(layer.fc.weight.grad is None for layer in layers)
    store.run("u")
    assert DEVICE.count.get("W") == 2
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
    """extra=3: x + grad_out parked of x + 3x saved, i.e. a w_memory of 0.5."""
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


# ---- asynchronous device -----------------------------------------------------------------------
# Ordering assertions only (which pass ran first, whether the host got back before a pass
# ended): no assertion on how long anything took.

@pytest.fixture
def stream() -> Iterator[DeviceStream]:
    s = DeviceStream()
    yield s
    s.close()


def test_stream_runs_passes_in_order(stream: DeviceStream) -> None:
    passes = [stream.enqueue(t, k) for t, k in ((0.005, "F"), (0.001, "B"), (0.003, "W"))]
    stream.synchronize()
    done = [p for p in stream.history if p.kind != "sync"]
    assert [p.kind for p in done] == ["F", "B", "W"]
    for before, after in zip(passes, passes[1:]):
        assert after.start >= before.end  # one pass at a time, in enqueue order
        assert after.finished_at >= before.finished_at  # type: ignore[operator]
    assert all(p.finished_at >= p.end for p in passes)  # type: ignore[operator]


def test_host_runs_ahead_and_synchronize_waits(stream: DeviceStream) -> None:
    long = stream.enqueue(0.3, "F")
    assert not long.done.is_set()  # enqueue returned while the pass is still running
    stream.synchronize()
    assert long.done.is_set()
    assert time.perf_counter() >= long.end


def test_transfer_time_model() -> None:
    model = TransferModel(latency_s=10e-6, bandwidth_bps=25e9)
    assert model.seconds(0) == pytest.approx(10e-6)
    assert model.seconds(25_000) == pytest.approx(10e-6 + 1e-6)


@pytest.fixture
def two_ranks(tmp_path: Path) -> Iterator[tuple[AsyncDevice, AsyncDevice]]:
    """Two ranks' devices sharing one ready table, as two processes share the file."""
    path = tmp_path / "table"
    a = AsyncDevice(0, ReadyTable(path), TransferModel(1e-3, 1e6))
    b = AsyncDevice(1, ReadyTable(path), TransferModel(1e-3, 1e6))
    yield a, b
    a.stream.close()
    b.stream.close()


def test_received_tensor_waits_for_producer_and_transfer(two_ranks: tuple[AsyncDevice, AsyncDevice]) -> None:
    a, b = two_ranks
    t = torch.randn(ROWS, DIM)
    a.run(0.2, "F")
    a.produced(t)  # sent right after F: ready when F ends, not when the host sent it
    ready = a.stream.tail_end
    b.consumed(t.clone())  # the same bytes, on the other rank
    nxt = b.run(0.001, "F")
    assert nxt.start == pytest.approx(ready + 1e-3 + t.numel() * 4 / 1e6)
    a.consumed(t)  # a rank's own tensor: stream order already covers it, no transfer
    assert a.run(0.001, "B").start == pytest.approx(ready)


def test_transfers_from_one_peer_share_its_communicator_stream(two_ranks: tuple[AsyncDevice, AsyncDevice]) -> None:
    # Two tensors ready at once from the same peer: the second transfer starts when the first ends.
    a, b = two_ranks
    t, u = torch.randn(ROWS, DIM), torch.randn(ROWS, DIM)
    a.run(0.1, "F")
    a.produced(t)
    a.produced(u)
    ready, hop = a.stream.tail_end, 1e-3 + t.numel() * 4 / 1e6
    b.consumed(t.clone())
    b.consumed(u.clone())
    assert b.run(0.001, "F").start == pytest.approx(ready + 2 * hop)


def test_unknown_tensor_does_not_wait(two_ranks: tuple[AsyncDevice, AsyncDevice]) -> None:
    _, b = two_ranks
    b.consumed(torch.randn(ROWS, DIM))
    t0 = time.perf_counter()
    assert b.run(0.001, "F").start <= time.perf_counter() and b.run(0.0, "F").start >= t0


def test_ready_table_key_is_the_bytes() -> None:
    x = torch.randn(ROWS, DIM)
    assert tensor_key(x) == tensor_key(x.clone().requires_grad_(True))
    assert tensor_key(x) != tensor_key(x + 1)


@pytest.fixture
def async_device(tmp_path: Path) -> Iterator[AsyncDevice]:
    dev = AsyncDevice(0, ReadyTable(tmp_path / "table"))
    DEVICE.attach(dev)
    yield dev
    DEVICE.attach(None)
    dev.stream.close()


@pytest.mark.parametrize("mode", ["linear", "graph"])
def test_async_layers_keep_gradients_and_enqueue_every_pass(mode: str, async_device: AsyncDevice) -> None:
    layers = make_layers(2, DIM, 1e-3, 1e-3, 1e-3, mode=mode, seed=6)
    model, ref = nn.Sequential(*layers), _reference(layers)
    x = torch.randn(ROWS, DIM, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    DEVICE.reset()
    model(x).pow(2).sum().backward()
    async_device.synchronize()
    assert dict(DEVICE.count) == {"F": 2, "B": 2, "W": 2}
    ref(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for got, want in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, want)


def test_fused_backward_publishes_input_grad_after_its_w(async_device: AsyncDevice) -> None:
    """A fused backward sends the stage's input gradient after the whole backward: its ready
    time must include the W passes, as a GPU send waits for all work enqueued before it."""
    model = nn.Sequential(*make_layers(2, DIM, 1e-3, 1e-3, 1e-3, mode="linear", seed=7))
    x = torch.randn(ROWS, DIM, requires_grad=True)
    model(x).sum().backward()
    last = async_device.stream.tail_end
    async_device.synchronize()
    kinds = [p.kind for p in async_device.stream.history if p.kind != "sync"]
    assert kinds[-2:] == ["B", "W"]  # the first layer's B, then its W
    hit = async_device.table.lookup(tensor_key(x.grad))
    assert hit is not None and hit[1] == pytest.approx(last)
