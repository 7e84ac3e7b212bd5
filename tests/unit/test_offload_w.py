"""Offloading what split backward keeps from B to W: the plan (pure), the simulator's count and
the runtime's copies on one CPU process.

The runtime tests drive ``Offloader`` and ``WeightGradStore`` as the engine does (``before_pass``
before every pass, the forward inside ``forward`` / ``after_forward``, B inside ``deferring``
then ``after_backward_input`` with the store's ``held``, W as ``store.run``) on a small MLP and
compare every gradient bit for bit with a fused backward without offload.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ds_vshape.runtime.measuring.memory import ActivationMeter
from ds_vshape.runtime.offload.offloader import Offloader
from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward
from ds_vshape.schedules import Costs, Kind, Schedule, generate, simulate
from ds_vshape.schedules.offload import offload_plan, w_reload_points
from ds_vshape.schedules.simulate import memory_peaks

from tests.unit.offload_drive import micro_batches, mlp, one_rank, passes

SPLIT = "0F0 0F1 0F2 0B0 0B1 0B2 0W0 0W1 0W2"


# ---- the plan and the simulator (pure) ---------------------------------------------------------
def test_w_reload_starts_one_pass_before_w_and_only_with_a_gap() -> None:
    schedule = Schedule.from_text(["0F0 0F1 0F2 0B0 0W0 0B1 0F3 0W1 0B2 0B3 0W2 0W3"], name="t", micro_batches=4,
                                  stage_to_rank=[0])
    units = frozenset({(0, mb, 0) for mb in range(4)})
    # mb 0: W right after B, nothing between: left. mb 1: B at 5, W at 7, reload at 6. mb 2: B at 8,
    # W at 10: reload at 9. mb 3: B at 9, W at 11: reload at 10. Units outside ``units`` are never taken.
    assert w_reload_points(schedule.ranks[0], units) == {6: ((0, 1, 0),), 9: ((0, 2, 0),), 10: ((0, 3, 0),)}
    assert w_reload_points(schedule.ranks[0], units - {(0, 2, 0)}) == {6: ((0, 1, 0),), 10: ((0, 3, 0),)}
    assert w_reload_points(schedule.ranks[0], units, lead=3) == {6: ((0, 1, 0),), 9: ((0, 2, 0),), 10: ((0, 3, 0),)}
    with pytest.raises(ValueError, match="lead"):
        w_reload_points(schedule.ranks[0], units, lead=0)


def test_plans_take_w_of_every_unit_with_a_gap_and_fused_backward_has_none() -> None:
    for rank in range(4):
        assert offload_plan(generate("1f1b", 4, 8), rank, 1.0).w_units == frozenset()
        for name in ("zb-h1", "v-half", "v-zb"):
            schedule = generate(name, 4, 8)
            plan = offload_plan(schedule, rank, 0.5)
            every = frozenset(a.unit for a in schedule.ranks[rank] if a.kind is Kind.F)
            # The W-kept share does not follow the activation share: every unit with a pass between B and W.
            gapped = frozenset().union(*w_reload_points(schedule.ranks[rank], every).values())
            assert plan.w_units == gapped, (name, rank)
            assert offload_plan(schedule, rank, 0.0).w_units == plan.w_units  # the plan; the runtime skips share 0
    half = offload_plan(generate("v-half", 4, 8), 3, 0.5)
    assert half.w_units - half.units  # V-Half at 0.5: the second chunk's W-kept tensors go too


def test_simulator_moves_w_kept_memory_to_host() -> None:
    """With W keeping half a unit, V-Half's first chunk offloaded with its W-kept part holds less on
    the device than with the W-kept part staying (the same plan without ``w_reload_at``)."""
    costs = Costs(w_memory=0.5)
    schedule = generate("v-half", 4, 16, costs=costs)
    moved = simulate(schedule, costs, offload=0.5)
    onefb = simulate(generate("1f1b", 4, 16), costs).max_peak_memory
    weight = lambda a: 1.0 / schedule.chunks_per_rank  # noqa: E731
    stays = [memory_peaks(actions, weight, kept_until_w=0.5,
                          plan=dataclasses.replace(offload_plan(schedule, rank, 0.5, costs=costs), w_reload_at={}))[0]
             for rank, actions in enumerate(schedule.ranks)]
    assert moved.max_peak_memory < max(stays), (moved.peak_memory, stays)
    assert moved.max_peak_memory <= 0.5 * onefb < max(stays), (moved.peak_memory, onefb, stays)


def test_slow_copies_delay_w_after_its_reload() -> None:
    schedule = generate("v-half", 4, 8)
    costs = Costs(copy=20.0, w_memory=1.0)
    slow = simulate(schedule, costs, offload=0.5)
    plan = offload_plan(schedule, 0, 0.5, costs=costs)
    b_end = {a.unit: e for s, e, a in slow.timeline[0] if a.kind is Kind.B}
    for start, _end, a in slow.timeline[0]:
        if a.kind is Kind.W and a.unit in plan.w_units:
            assert start >= b_end[a.unit] + 2 * 20.0 / 2 - 1e-9  # out and back, 1/v M_B each way


# ---- the runtime on one CPU process ------------------------------------------------------------
def _model() -> nn.Sequential:
    return mlp()


def _run(share: float, *, order: str = SPLIT, observe: list | None = None
         ) -> tuple[list[torch.Tensor], ActivationMeter, Offloader, WeightGradStore]:
    """Three micro-batches through ``order`` as the engine runs them; returns the gradients, the
    meter, the offloader and the store. ``observe`` gets (pass, parked device bytes, W host bytes)
    after every B."""
    model = _model()
    store = WeightGradStore()
    enable_split_backward([model], store)
    schedule, ops = one_rank(order)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    off = Offloader(meter, share=share, device=torch.device("cpu"), rank=0, min_bytes=0,
                    parked=lambda: store.parked_bytes)
    xs = micro_batches()
    off.start_step(schedule, ops, train=True)
    meter.reset_peak()
    outs: dict[int, torch.Tensor] = {}
    for op, kind, unit, mb in passes(off, ops):
        if kind is Kind.F:
            with off.forward(unit, [xs[mb]], measure=True), store.forward_of(unit):
                outs[mb] = model(xs[mb])
            off.after_forward(unit, [xs[mb], outs[mb]])
        elif kind is Kind.B:
            with store.deferring(unit):
                outs.pop(mb).pow(2).sum().backward()
            off.after_backward_input(unit, store.held(unit), live=[xs[mb].grad])
            if observe is not None:
                observe.append((str(op), meter._extra.get("parked", 0), off._w.host_bytes))
        elif kind is Kind.W:
            store.run(unit)
            off.count_parked()
        else:
            with store.backward_of(unit, defer=False):
                outs.pop(mb).pow(2).sum().backward()
    assert off.pending() == [] and store.pending() == []
    return [p.grad for p in model.parameters()] + [x.grad for x in xs], meter, off, store


def test_w_kept_tensors_go_to_host_and_come_back_bit_exact() -> None:
    fused, meter0, _, _ = _run(0.0, order="0F0 0F1 0F2 0BW0 0BW1 0BW2")
    plain_log: list = []
    plain, meter1, _, _ = _run(0.0, observe=plain_log)
    moved_log: list = []
    moved, meter2, off, store = _run(1.0, observe=moved_log)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert all(torch.equal(a, b) for a, b in zip(fused, moved))
    assert off._w_units == {(0, 0, 0), (0, 1, 0), (0, 2, 0)}
    # Every parked byte is on the device or on the host. Only the stage input (the first Linear's,
    # 8x16 fp32) stays: the engine holds it. W0's reload starts with the pass before W0 (B2): after
    # B0 and B1 only the inputs are on the device, after B2 unit 0's whole share is back too.
    unit, x = plain_log[0][1], 8 * 16 * 4
    assert [op for op, _, _ in moved_log] == [op for op, _, _ in plain_log]
    assert [parked + host for _, parked, host in moved_log] == [parked for _, parked, _ in plain_log] == [unit, 2 * unit, 3 * unit]
    assert [parked for _, parked, _ in moved_log] == [x, 2 * x, unit + 2 * x], moved_log
    assert meter2.peak_host_bytes >= max(host for _, _, host in moved_log) == 2 * (unit - x)
    assert meter2.peak_bytes < meter1.peak_bytes
    assert store.parked_bytes == 0 and off._w.host_bytes == 0 and meter2.host_bytes == 0


def test_w_right_after_b_stays_on_the_device() -> None:
    log: list = []
    grads, _, off, _ = _run(1.0, order="0F0 0F1 0F2 0B0 0W0 0B1 0W1 0B2 0W2", observe=log)
    assert off._w_units == frozenset() and all(host == 0 and parked > 0 for _, parked, host in log), log
    fused = _run(0.0, order="0F0 0F1 0F2 0BW0 0BW1 0BW2")[0]
    assert all(torch.equal(a, b) for a, b in zip(fused, grads))


def test_live_tensors_stay_on_the_device() -> None:
    """A W-kept storage named live (here: every held one) is not offloaded."""
    model = _model()
    store = WeightGradStore()
    enable_split_backward([model], store)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    off = Offloader(meter, share=1.0, device=torch.device("cpu"), rank=0, min_bytes=0, parked=lambda: store.parked_bytes)
    schedule, ops = one_rank(SPLIT)
    off.start_step(schedule, ops, train=True)
    unit = (0, 0, 0)
    x = torch.randn(8, 16, requires_grad=True)
    off.before_pass(Kind.F, unit)
    with off.forward(unit, [x], measure=True), store.forward_of(unit):
        out = model(x)
    off.after_forward(unit, [x, out])
    for mb in (1, 2):
        off.before_pass(Kind.F, (0, mb, 0))
    off.before_pass(Kind.B, unit)
    with store.deferring(unit):
        out.sum().backward()
    held = store.held(unit)
    assert held and all(t.untyped_storage().nbytes() > 0 for t in held)
    off.after_backward_input(unit, held, live=held)
    assert off._w.host_bytes == 0 and all(t.untyped_storage().nbytes() > 0 for t in held)
