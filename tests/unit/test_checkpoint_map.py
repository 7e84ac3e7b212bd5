"""Pure helpers of cross-placement checkpoints: the load plan, its refusals, mapping optimizer state by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_vshape.runtime.dropin.checkpoint import CheckpointError, Layout, mapped_state_dict, needed_ranks, plan_load

HOLDERS_V = {"0": [0], "1": [1], "2": [1], "3": [0]}  # v-half at p=2, one layer a stage


def _layout(schedule: str | None = "v-half", *, p: int = 2, placement: tuple[int, ...] = (0, 1, 1, 0),
            mapped: bool = True, layers: int | None = 4, **kw: Any) -> Layout:
    return Layout(schedule=schedule, p=p, placement=placement, stage_parts=kw.pop("parts", (0, 1, 2, 3, 4)),
                  num_layers=layers, zero_stage=kw.pop("zero", 0), optimizer=kw.pop("optimizer", "AdamW"), mapped=mapped,
                  holders=kw.pop("holders", HOLDERS_V))


ONE_F_ONE_B = _layout("1f1b", placement=(0, 0, 1, 1), parts=(0, 1, 2, 3, 4), holders={"0": [0], "1": [0], "2": [1], "3": [1]})


def test_layout_survives_json() -> None:
    layout = _layout()
    assert Layout.from_json(layout.to_json(), path="x") == layout


def test_plan_keeps_deepspeed_load_for_the_saving_placement_and_maps_otherwise() -> None:
    assert plan_load(_layout(), _layout(), load_optimizer=True, where="d", rank=0) == "stock"
    assert plan_load(ONE_F_ONE_B, _layout(), load_optimizer=True, where="d", rank=0) == "mapped"
    assert plan_load(ONE_F_ONE_B, _layout(), load_optimizer=False, where="d", rank=0) == "weights"


@pytest.mark.parametrize(
    ("saved", "current", "needles"),
    [
        (_layout("1f1b", placement=(0, 1), mapped=False, zero=1, optimizer="DeepSpeedZeroOptimizer(AdamW)"),
         _layout(zero=1, mapped=False), ["'1f1b' at p=2", "'v-half' at p=2", "ZeRO stage 1", "load_optimizer_states=False",
                                         "pipeline.schedule='1f1b' with 2 pipeline stages"]),
        (Layout(None, 2, (0, 1), None, None, 0, "unknown", False), _layout(),
         ["stock DeepSpeed (1f1b) at p=2", "parameter order", "wrong layers", "load_optimizer_states=False"]),
        (ONE_F_ONE_B, _layout(mapped=False, optimizer="BF16_Optimizer(AdamW)"), ["this run's optimizer (BF16_Optimizer(AdamW)"]),
    ],
)
def test_plan_refuses_what_cannot_map(saved: Layout, current: Layout, needles: list[str]) -> None:
    with pytest.raises(CheckpointError) as err:
        plan_load(saved, current, load_optimizer=True, where="d", rank=3)
    for needle in needles + ["rank 3:"]:
        assert needle in str(err.value), (needle, str(err.value))


def test_stock_checkpoint_at_the_same_linear_placement_loads() -> None:
    stock = Layout(None, 2, (0, 1), None, None, 0, "unknown", False)
    assert plan_load(stock, _layout("1f1b", placement=(0, 1)), load_optimizer=True, where="d", rank=0) == "stock"


def test_layer_count_and_unit_differences_are_errors_even_for_weights() -> None:
    with pytest.raises(CheckpointError, match="4 layers but this PipelineModule has 6"):
        plan_load(_layout(), _layout(layers=6), load_optimizer=False, where="d", rank=0)
    with pytest.raises(CheckpointError, match="tied_modules.e"):
        plan_load(_layout(), _layout(holders={**HOLDERS_V, "tied_modules.e": [0]}), load_optimizer=False, where="d", rank=0)


def _optimizer() -> tuple[torch.optim.Optimizer, dict[int, str]]:
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.AdamW([a, b], lr=0.1), {id(a): "0.fc.weight", id(b): "3.fc.bias"}


def _payload(rank: int, params: dict[str, Any], *, groups: list[dict[str, Any]] | None = None, cls: str = "AdamW") -> dict:
    return {"pipe_rank": rank, "optimizer": cls, "groups": groups or [{"lr": 0.05, "weight_decay": 0.1}], "params": params}


def _entry(shape: tuple[int, ...], fill: float, group: int = 0) -> dict[str, Any]:
    return {"group": group, "shape": shape, "state": {"exp_avg": torch.full(shape, fill), "step": torch.tensor(3.0)}}


def test_state_maps_by_name_from_the_rank_that_held_each_layer() -> None:
    opt, names = _optimizer()
    payloads = {0: _payload(0, {"3.fc.bias": _entry((3,), 2.0), "0.fc.weight": _entry((2, 3), 1.0)})}
    sd, error = mapped_state_dict(opt, names, _layout(), payloads)
    assert error is None
    opt.load_state_dict(sd)
    a, b = opt.param_groups[0]["params"]
    assert opt.state[a]["exp_avg"].eq(1.0).all() and opt.state[b]["exp_avg"].eq(2.0).all()
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["weight_decay"] == 0.1  # the saved group's options
    assert needed_ranks(_layout(), list(names.values())) == [0]


@pytest.mark.parametrize(
    ("params", "extra", "needle"),
    [
        ({"0.fc.weight": _entry((2, 3), 1.0)}, {}, "no optimizer state for 3.fc.bias in pipeline rank 0's file"),
        ({"0.fc.weight": _entry((3, 2), 1.0), "3.fc.bias": _entry((3,), 2.0)}, {}, "0.fc.weight has shape (3, 2)"),
        ({"0.fc.weight": _entry((2, 3), 1.0), "3.fc.bias": _entry((3,), 2.0)}, {"cls": "SGD"}, "optimizer is ['SGD']"),
        ({"0.fc.weight": _entry((2, 3), 1.0), "3.fc.bias": _entry((3,), 2.0, group=1)},
         {"groups": [{"weight_decay": 0.1}, {"weight_decay": 0.0}]}, "group the parameters as when saving"),
    ],
)
def test_state_that_cannot_map_is_an_error_not_a_misplacement(params: dict, extra: dict, needle: str) -> None:
    opt, names = _optimizer()
    sd, error = mapped_state_dict(opt, names, _layout(), {0: _payload(0, params, **extra)})
    assert sd == {} and error is not None and needle in error, error
