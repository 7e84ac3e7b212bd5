"""Activation offload: which units go (pure plan), and the runtime's copies on one CPU process.

The runtime tests drive ``Offloader`` as the engine does (``start_step``, ``before_pass`` and
``forward`` / ``after_forward`` around each forward, ``before_pass`` before each backward) on
a small MLP and compare every gradient bit for bit with a plain run.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from ds_vshape.runtime.measuring.memory import ActivationMeter
from ds_vshape.runtime.offload.offloader import HostPool, Offloader
from ds_vshape.runtime.offload.setup import check_offload_config, offload_notes
from ds_vshape.schedules import Kind, Schedule, generate
from ds_vshape.schedules.offload import lifespans, offload_plan, offload_units, reload_points

from tests.unit.offload_drive import micro_batches, mlp, one_rank, passes



# ---- the plan (pure) ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["v-half", "v-zb", "v-min"])
@pytest.mark.parametrize("p", [2, 4])
def test_half_share_on_v_placement_is_the_first_chunk(name: str, p: int) -> None:
    schedule = generate(name, p, 2 * p)
    for rank in range(p):
        first = schedule.stages_of_rank(rank)[0]
        want = {(first, mb, 0) for mb in range(2 * p)}
        assert offload_units(schedule, rank, 0.5) == want, (name, p, rank)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "v-half", "seq1f1b"])
def test_shares_are_bounded_nested_and_skip_units_without_a_gap(name: str) -> None:
    schedule = generate(name, 4, 8)
    for rank in range(4):
        spans = lifespans(schedule.ranks[rank])
        previous: frozenset = frozenset()
        for share in (0.0, 0.25, 0.5, 0.75, 1.0):
            units = offload_units(schedule, rank, share)
            assert len(units) <= share * len(spans) + 1e-9
            assert previous <= units  # equal weights: a larger share takes more of the same order
            assert all(spans[u] >= 2 for u in units)
            previous = units
        assert previous == {u for u, s in spans.items() if s >= 2}
    assert offload_units(generate("1f1b", 4, 8), 3, 1.0) == frozenset()  # the last stage: B right after F


def test_longest_lived_stage_goes_first() -> None:
    schedule = Schedule.from_text(["0F0 1F0 0F1 1F1 1B0 1B1 0B0 0B1"], name="t", micro_batches=2, stage_to_rank=[0, 0])
    assert lifespans(schedule.ranks[0]) == {(0, 0, 0): 6, (1, 0, 0): 3, (0, 1, 0): 5, (1, 1, 0): 2}
    assert offload_units(schedule, 0, 0.25) == {(0, 0, 0)}
    assert offload_units(schedule, 0, 0.5) == {(0, 0, 0), (0, 1, 0)}
    assert offload_plan(schedule, 0, 0.5).share == 0.5


def test_reload_starts_one_pass_before_the_backward() -> None:
    schedule = generate("v-half", 2, 4)
    for rank in range(2):
        plan = offload_plan(schedule, rank, 1.0)
        passes = schedule.ranks[rank]
        reloads = {u: at for at, units in plan.reload_at.items() for u in units}
        assert set(reloads) == plan.units
        for unit, at in reloads.items():
            forward = next(i for i, a in enumerate(passes) if a.kind is Kind.F and a.unit == unit)
            backward = next(i for i, a in enumerate(passes) if a.kind.is_backward and a.unit == unit)
            assert forward < at == backward - 1


def test_bad_share_and_bad_order_are_refused() -> None:
    schedule = generate("1f1b", 2, 4)
    for share in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="pipeline.offload"):
            offload_units(schedule, 0, share)
    with pytest.raises(ValueError, match="no backward"):
        reload_points(schedule.ranks[0][:2], frozenset({(0, 0, 0)}))
    with pytest.raises(ValueError, match="cpu_checkpointing"):
        check_offload_config({"activation_checkpointing": {"cpu_checkpointing": True}}, share=0.5)
    check_offload_config({"activation_checkpointing": {"cpu_checkpointing": True}}, share=0.0)


# ---- the runtime on one CPU process ------------------------------------------------------------------
ORDER = "0F0 0F1 0F2 0BW0 0BW1 0BW2"


def _model() -> nn.Module:
    return mlp()


def _run(model: nn.Module, share: float, *, steps: int = 1, order: str = ORDER, inplace: bool = False
         ) -> tuple[list[torch.Tensor], ActivationMeter, Offloader, list[int]]:
    """Forward three micro-batches, then backward them, as the engine would; returns the grads,
    the meter, the offloader and the device bytes after each forward."""
    schedule, ops = one_rank(order)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    off = Offloader(meter, share=share, device=torch.device("cpu"), rank=0, min_bytes=0)
    xs = micro_batches()
    after_forward: list[int] = []
    for _ in range(steps):
        off.start_step(schedule, ops, train=True)
        meter.reset_peak()
        outs: dict[int, torch.Tensor] = {}
        for _op, kind, unit, mb in passes(off, ops):
            if kind is Kind.F:
                with off.forward(unit, [xs[mb]], measure=True):
                    h = model[0](xs[mb])
                    if inplace:
                        h.mul_(2)  # in place after Linear saved nothing of it, but GELU saves h below
                    out = model[1:](h)
                    if inplace:
                        h.add_(1)
                off.after_forward(unit, [xs[mb], out])
                outs[mb] = out
                after_forward.append(meter.live_bytes + meter.extra_bytes)
            else:
                outs.pop(mb).pow(2).sum().backward()
        assert off.pending() == []
    return [p.grad for p in model.parameters()] + [x.grad for x in xs], meter, off, after_forward


def test_a_unit_whose_backward_follows_at_once_stays() -> None:
    _, _, off, _ = _run(_model(), 1.0, order="0F0 0F1 0BW1 0F2 0BW2 0BW0")
    assert off.units == {(0, 0, 0)}


def test_offloaded_gradients_are_bit_exact_and_device_bytes_fall() -> None:
    plain, meter0, _, device0 = _run(_model(), 0.0)
    offl, meter1, off, device1 = _run(_model(), 1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, offl))
    assert off.units == {(0, 0, 0), (0, 1, 0), (0, 2, 0)}
    assert meter1.peak_host_bytes > 0 and meter0.peak_host_bytes == 0
    # After each forward its activations are on the host (the meter keeps the kept inputs' bytes only),
    # until micro-batch 0's reload starts with the pass before its backward: the third forward.
    unit = device0[0] - device1[0]
    assert device1[1] < device0[1] / 4 and device1[2] == device1[1] + device1[0] + unit, (device0, device1)
    assert meter1.peak_bytes < meter0.peak_bytes
    assert off.device_bytes == 0 and off.host_bytes == 0 and meter1.host_bytes == 0  # all back and released
    # Every byte is somewhere: saved bytes with offload equal those without, at each forward's end.
    assert meter1.live_bytes == 0 and meter1.extra_bytes == 0


def test_pool_buffers_are_reused_across_steps() -> None:
    _, _, off, _ = _run(_model(), 1.0, steps=3)
    one_step = _run(_model(), 1.0, steps=1)[2]._pool.allocated_bytes
    assert off._pool.allocated_bytes == one_step > 0


def test_inputs_and_outputs_stay_on_the_device() -> None:
    _, meter, off, _ = _run(_model(), 1.0)
    # Two offloaded units of 8x64 activations (GELU's and Tanh's inputs, the Linear inputs), never the
    # 8x16 input or output: with them the host peak would be larger by 2 x 2 x 512 bytes.
    per_unit = meter.peak_host_bytes // 2
    assert per_unit % (8 * 64 * 4) == 0, per_unit


def test_write_in_place_after_save_is_refused() -> None:
    with pytest.raises(RuntimeError, match="wrote a tensor in place after autograd saved it"):
        _run(_model(), 1.0, inplace=True)


def test_pool_waits_for_nothing_on_the_cpu() -> None:
    pool = HostPool(pin=False)
    a = pool.take(64)
    pool.give(a)
    assert pool.take(64) is a and pool.allocated_bytes == 64
    assert pool.take(64) is not a and pool.allocated_bytes == 128


def test_notes_say_what_stays_on_the_device() -> None:
    assert offload_notes(0.0, checkpoint_interval=1, split_backward=True) == []
    notes = offload_notes(0.5, checkpoint_interval=2, split_backward=True)
    assert "from B to W" in notes[0] and "activation_checkpoint_interval=2" in notes[1]
    assert offload_notes(0.5, checkpoint_interval=0, split_backward=False) == []


def test_outputs_the_engine_holds_stay_on_the_device() -> None:
    """Tanh saves its output, which is the stage output the engine keeps: copying it would free nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh())
    schedule, ops = one_rank("0F0 0F1 0BW0 0BW1", micro_batches=2)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    off = Offloader(meter, share=1.0, device=torch.device("cpu"), rank=0, min_bytes=0)
    off.start_step(schedule, ops, train=True)
    x = torch.randn(8, 16, requires_grad=True)
    off.before_pass(Kind.F, (0, 0, 0))
    with off.forward((0, 0, 0), [x], measure=True):
        out = model(x)
    off.after_forward((0, 0, 0), [x, out])
    assert (0, 0, 0) in off.units and off.host_bytes == 0 and off.offloaded_units == 0
    assert meter.live_bytes == x.nbytes + out.nbytes  # both counted once, by the meter


def test_saved_tensors_go_to_host_as_saved_and_freed_addresses_are_not_confused() -> None:
    """With each saved tensor copied as autograd saves it, the forward frees the device tensors it is
    done with, and the allocator hands their addresses to the next layers' tensors: a unit's saved
    bytes never pile up on the device, and no slot takes a new storage for the one it copied."""
    def deep() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), *[m for _ in range(12) for m in (nn.Tanh(), nn.Linear(64, 64))])

    plain, _, _, _ = _run(deep(), 0.0)
    offl, _, off, _ = _run(deep(), 1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, offl))
    assert off.offloaded_units == 3
    peaks = [_forward_peak(deep(), share) for share in (0.0, 1.0)]
    # Inside the forward, with offload, at most about one saved storage is on the device at a time.
    assert peaks[1] <= 2 * 8 * 64 * 4 and 5 * peaks[1] < peaks[0], peaks


def _forward_peak(model: nn.Module, share: float) -> int:
    """The device peak of saved bytes during one unit's forward (the unit offloaded at ``share`` 1)."""
    schedule, ops = one_rank("0F0 0F1 0BW0 0BW1", micro_batches=2)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    off = Offloader(meter, share=share, device=torch.device("cpu"), rank=0, min_bytes=0)
    off.start_step(schedule, ops, train=True)
    x = torch.randn(8, 16, requires_grad=True)
    meter.reset_peak()
    off.before_pass(Kind.F, (0, 0, 0))
    with off.forward((0, 0, 0), [x], measure=True):
        out = model(x)
    off.after_forward((0, 0, 0), [x, out])
    return meter.peak_bytes


def test_a_storage_saved_again_after_autograd_let_it_go_gets_a_fresh_slot() -> None:
    """A forward whose first use of ``h`` builds a graph it then drops (autograd frees that saved
    tensor while the forward runs), and which saves ``h`` again: exact, no stale slot reused."""
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            dropped = h.pow(2)  # pow saves h; the graph is dropped at once, and autograd lets h's copy go
            del dropped
            return self.b(h.pow(3))  # h saved again: the same storage, at the same address

    def run(s: float) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Identity(), Twice())
        return _run(model, s)[0]

    assert all(torch.equal(a, b) for a, b in zip(run(0.0), run(1.0)))


def test_a_stage_output_saved_then_let_go_is_not_counted_off_twice() -> None:
    """The output is saved by an op whose graph the forward drops, then returned (the engine keeps
    it): its slot holds nothing at the forward's end, and the device figure ends at zero."""
    class Out(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.a(x)
            dropped = out.pow(2)  # saves out; dropped at once
            del dropped
            return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), Out())
    plain = _run(copy.deepcopy(model), 0.0)[0]
    grads, _, off, _ = _run(model, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    assert off.device_bytes == 0 and off.host_bytes == 0, (off.device_bytes, off.host_bytes)
