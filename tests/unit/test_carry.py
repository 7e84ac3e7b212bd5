"""Pure helpers of the drop-in carry: unit names, the copy plan, parameter-group forms, config default."""

from __future__ import annotations

import pytest
import torch

from ds_vshape.config import ConfigError, parse_pipeline_config
from ds_vshape.runtime.dropin.carry import _plan, unit_of
from ds_vshape.runtime.dropin.optim_carry import as_groups


@pytest.mark.parametrize(("name", "unit"), [("3.fc.weight", "3"), ("12.norm.bias", "12"),
                                            ("tied_modules.embed.weight", "tied_modules.embed"), ("loss_fn.w", "loss_fn")])
def test_unit_of_names_the_layer_or_tied_module(name: str, unit: str) -> None:
    assert unit_of(name) == unit


def test_plan_copies_moved_layers_from_their_stock_rank_and_tied_from_the_lowest() -> None:
    old = {"0": [0], "1": [0], "2": [1], "3": [1], "tied_modules.e": [0, 1]}
    fresh = {"0": [0], "1": [1], "2": [1], "3": [0], "tied_modules.e": [0, 1]}
    assert _plan(old, fresh) == [("1", 0, 1), ("3", 1, 0), ("tied_modules.e", 0, 1)]


def test_plan_is_empty_when_nothing_moves() -> None:
    same = {"0": [0], "1": [1]}
    assert _plan(same, same) == []


def test_as_groups_keeps_flat_lists_flat_and_group_options() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    groups, flat = as_groups(iter([a, b]), what="model_parameters")
    assert flat and groups == [{"params": [a, b]}]
    groups, flat = as_groups([{"params": a, "weight_decay": 0.0}, {"params": (b,), "lr": 0.1}], what="model_parameters")
    assert not flat and groups == [{"params": [a], "weight_decay": 0.0}, {"params": [b], "lr": 0.1}]


@pytest.mark.parametrize("bad", [[{"lr": 0.1}], [("w", torch.zeros(1))]])
def test_as_groups_refuses_what_it_cannot_map(bad: list) -> None:
    with pytest.raises(ConfigError, match="model_parameters"):
        as_groups(bad, what="model_parameters")


def test_partition_method_defaults_to_the_stock_modules() -> None:
    assert parse_pipeline_config({"pipeline": {"schedule": "v-half"}}).partition_method is None
    assert parse_pipeline_config({"pipeline": {"schedule": "v-half", "partition_method": "uniform"}}).partition_method == "uniform"
