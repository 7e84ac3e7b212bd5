"""``WFit``: what split backward keeps from B to W is fitted to the schedule's ``w_memory``.

The choice (``choose``) is checked alone; then on the recipe's tiny Llama block, whose W would
keep 0.766 of what its forward saves: with ``w_memory`` 0.5 the first B moves the cheapest
groups' weight gradients into B (attention's output projection and the MLP's down projection,
each one GEMM with an input of its own), W keeps at most half from then on, gradients equal a
fused backward's, and nothing warns. Shares 1 and 0 move nothing and everything; work that
cannot move (a custom Function) is never counted as freed, and a share it makes unreachable is
reported naming the field and the value to set.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.kept_share import Stage, layer_stages
from ds_vshape.runtime.measuring.memory import ActivationMeter
from ds_vshape.runtime.split.fit import Group, WFit, choose, group_works
from ds_vshape.runtime.split.split_backward import SplitBackwardWarning, WeightGradStore, enable_split_backward

from tests.unit.test_split_custom import Linear


def test_nothing_to_free_picks_nothing() -> None:
    assert choose([Group(100, 1.0)], excess=0) == [] and choose([Group(100, 1.0)], excess=-5) == []


def test_groups_are_taken_by_bytes_freed_per_cost() -> None:
    groups = [Group(100, 100.0), Group(100, 10.0), Group(50, 1.0)]
    assert choose(groups, excess=120) == [1, 2]  # 50/1 first, then 100/10; 100/100 not needed
    assert choose(groups, excess=40) == [2]


def test_picks_the_greedy_order_did_not_need_are_dropped() -> None:
    # 10/1 is taken first, then 100/20 alone covers the excess: the first pick goes again.
    assert choose([Group(10, 1.0), Group(100, 20.0)], excess=100) == [1]


def test_not_enough_to_free_takes_everything() -> None:
    assert choose([Group(10, 1.0), Group(20, 1.0)], excess=1000) == [0, 1]


def test_free_work_goes_first() -> None:
    assert choose([Group(10, 5.0), Group(10, 0.0)], excess=10) == [1]


def test_a_cost_budget_skips_the_groups_past_it() -> None:
    groups = [Group(freed=100, cost=10.0), Group(freed=60, cost=2.0), Group(freed=50, cost=3.0)]
    assert choose(groups, excess=150) == [0, 1]
    assert choose(groups, excess=150, budget=6.0) == [1, 2]  # the best ratio first, the costly one skipped
    assert choose(groups, excess=150, budget=0.0) == []


def test_the_fit_moves_no_more_work_than_the_schedule_allows_and_states_the_trade(block: Stage) -> None:
    """Past the share of W's work a schedule can take into B before it falls behind 1F1B
    (``schedules.fit_limit``), nothing more moves: W then keeps more than w_memory, and the
    warning says by how much and which w_memory would count it."""
    free = copy.deepcopy(block.module)
    full, _, _, _ = _units(free, block.inputs, 0.5, units=1)
    model = copy.deepcopy(block.module)
    reference = _fused_grads(copy.deepcopy(block.module), block.inputs)
    with pytest.warns(SplitBackwardWarning, match=r"falls behind 1F1B \(0\.1 of it, simulated\).* KiB more per unit"):
        fit, store, said, _ = _units(model, block.inputs, 0.5, warn=True, max_moved=0.1)
    saved, kept, after = fit.fitted[0]
    assert full.fitted[0][2] <= 0.5 * saved < after < kept  # less moved than the unlimited fit moved
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-5, atol=1e-7, msg=name)
    with pytest.warns(SplitBackwardWarning, match=r"\(0 of it, simulated\)"):
        _, _, said_none, _ = _units(copy.deepcopy(block.module), block.inputs, 0.5, warn=True, max_moved=0.0)
    assert said_none == [None, None]  # nothing may move: nothing moved, nothing said beyond the warning


@pytest.fixture(scope="module")
def block() -> Stage:
    return {s.kind: s for s in layer_stages(size="tiny", attn="sdpa", seq_len=64)}["decoder block"]


def _units(model: nn.Module, inputs: Callable[[], Any], share: float | None, *, units: int = 2, warn: bool = False,
           max_moved: float = 1.0) -> tuple[WFit, WeightGradStore, list[str | None], list[int]]:
    """``units`` micro-batches of one stage, each forward measured by the engine's meter, B, the fit, W."""
    store = WeightGradStore()
    enable_split_backward([model], store, root=model)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    fit, said, parked = WFit(store), [], []
    for mb in range(units):
        key = (0, mb, 0)
        measure = fit.forward_starts(key)
        before = meter.saved_bytes
        with store.forward_of(key, scope=0), meter.recording():
            out = model(inputs())
            out = out[0] if isinstance(out, tuple) else out
        if measure:
            fit.saw_forward(0, meter.saved_bytes - before)
        with warnings.catch_warnings():
            if not warn:
                warnings.simplefilter("error", SplitBackwardWarning)
            with store.deferring(key):
                out.backward(torch.full_like(out, 1e-3))
            said.append(fit.after_backward_input(key, share=share, run_now=lambda run: run(), rank=0,
                                                 max_moved=lambda: max_moved))
        parked.append(store.parked_bytes)
        store.run(key)
    return fit, store, said, parked


def _fused_grads(model: nn.Module, inputs: Callable[[], Any], units: int = 2) -> dict[str, torch.Tensor]:
    for _ in range(units):
        out = model(inputs())
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.full_like(out, 1e-3))
    return {n: p.grad for n, p in model.named_parameters()}


def test_half_moves_the_cheapest_gemms_into_b_and_stays_exact(block: Stage) -> None:
    model = copy.deepcopy(block.module)
    fit, store, said, parked = _units(model, block.inputs, 0.5, units=3)
    saved, kept, after = fit.fitted[0]
    assert kept > 0.7 * saved and after <= 0.5 * saved, (saved, kept, after)
    assert all(p <= 0.5 * saved for p in parked), (parked, saved)  # the first unit after its fit, and the later ones
    assert parked[1] == parked[2] == after  # later units park only what W still does
    assert said[1:] == [None, None] and said[0] is not None
    assert "block.self_attn.o_proj" in said[0] and "block.mlp.down_proj" in said[0] and "w_memory 0.5" in said[0]
    in_b = {n for n, p in model.named_parameters() if p.dim() > 1 and id(p) in store._in_b}
    assert in_b == {"block.self_attn.o_proj.weight", "block.mlp.down_proj.weight"}
    reference = _fused_grads(copy.deepcopy(block.module), block.inputs, units=3)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-5, atol=1e-7, msg=name)


def test_share_one_moves_nothing_and_share_zero_everything(block: Stage) -> None:
    fit, store, said, parked = _units(copy.deepcopy(block.module), block.inputs, 1.0)
    assert said == [None, None] and fit.fitted == {} and parked[0] == parked[1] > 0
    fit, store, said, parked = _units(copy.deepcopy(block.module), block.inputs, 0.0)
    assert parked == [0, 0] and fit.fitted[0][2] == 0 and said[0] is not None


def test_a_schedule_without_w_memory_is_left_alone(block: Stage) -> None:
    fit, _, said, parked = _units(copy.deepcopy(block.module), block.inputs, None)
    assert said == [None, None] and fit.fitted == {} and parked[0] == parked[1] > 0


class _CustomThenLinear(nn.Module):
    """A custom Function's linear (its work stays for W) and a plain one (movable), reading one input."""

    def __init__(self) -> None:
        super().__init__()
        self.custom, self.plain = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(x).tanh() + Linear.apply(x, self.custom.weight, None)  # tanh: a gradient of its own


def _custom_inputs() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()


def test_a_custom_functions_storages_are_never_counted_as_freed() -> None:
    model = _CustomThenLinear()
    store = WeightGradStore()
    enable_split_backward([model], store, root=model)
    with store.forward_of(0, scope=0):
        out = model(_custom_inputs())
    with store.deferring(0):
        out.backward(torch.ones_like(out))
    groups = group_works(store.parked_of(0), skip=store.param_storages)
    # Only the plain GEMM moves; its input is the custom Function's too, whose W keeps it.
    assert len(groups) == 1 and groups[0][1].freed == 8 * 16 * 4  # its output gradient alone
    store.run(0)


def test_an_unreachable_share_names_the_field_and_the_value() -> None:
    model = _CustomThenLinear()
    reference = _fused_grads(copy.deepcopy(model), _custom_inputs)
    with pytest.warns(SplitBackwardWarning, match=r"pipeline.w_memory 0 that .* set w_memory to \d\.\d\d"):
        fit, store, said, parked = _units(model, _custom_inputs, 0.0, warn=True)
    assert fit.fitted[0][2] > 0 and said[0] is not None and parked[1] == fit.fitted[0][2]
    assert [n for n, p in model.named_parameters() if id(p) in store._in_b] == ["plain.weight"]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-5, atol=1e-7, msg=name)


def test_undo_gives_the_moved_gradients_back_to_w_and_fits_again(block: Stage) -> None:
    model = copy.deepcopy(block.module)
    fit, store, said, parked = _units(model, block.inputs, 0.5, units=1)
    matrices = {n for n, p in model.named_parameters() if p.dim() > 1 and id(p) in store._in_b}
    assert matrices and fit.forward_starts((0, 1, 0)) is False
    fit.undo()  # auto installing a schedule that counts another share
    assert not {n for n, p in model.named_parameters() if p.dim() > 1 and id(p) in store._in_b}
    assert all(id(p) in store._in_b for p in model.parameters() if p.dim() <= 1)  # cheap ones stay B's
    assert fit.forward_starts((0, 1, 0)) and fit.fitted == {}


def test_units_forwarded_before_the_fit_accumulate_in_micro_batch_order() -> None:
    """A V schedule runs forwards of later micro-batches before the first B. Their B parks the
    work the fit then moves; it runs at their B, so every moved gradient lands in micro-batch
    order, as in a fused backward: bit for bit the same sums (out of order they differ in the
    last bits, which training over many steps amplifies past 1e-5)."""
    from tests.distributed.worker import Block

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    reference = copy.deepcopy(model)
    xs = [torch.randn(4, 8) for _ in range(4)]
    for x in xs:
        out = reference(x.requires_grad_(False).clone().requires_grad_())
        out.backward(torch.ones_like(out))
    store = WeightGradStore()
    enable_split_backward([model], store, root=model)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
    fit, outs, said = WFit(store), {}, []

    def forward(mb: int) -> None:
        measure, before = fit.forward_starts((0, mb, 0)), meter.saved_bytes
        with store.forward_of((0, mb, 0), scope=0), meter.recording():
            outs[mb] = model(xs[mb].clone().requires_grad_())
        if measure:
            fit.saw_forward(0, meter.saved_bytes - before)

    def backward(mb: int) -> None:
        with store.deferring((0, mb, 0)):
            outs[mb].backward(torch.ones_like(outs[mb]))
        said.append(fit.after_backward_input((0, mb, 0), share=0.5, run_now=lambda run: run(), rank=0))

    passes = {"F": forward, "B": backward, "W": lambda mb: store.run((0, mb, 0))}
    for op in "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3".split():  # rank 0's order under V-ZB at p=2, m=4
        passes[op[0]](int(op[1]))
    assert said[0] is not None and "3.fc" in said[0]
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
