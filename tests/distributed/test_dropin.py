"""``ds_vshape.initialize`` as a drop-in: the job's weights, optimizer setup and partition hold.

One 2-rank launch runs every case (tests/distributed/dropin_checks.py); each trains against a
plain model started from the same weights with the same optimizer setup (fp32, 1e-5), or
records the refusal it must give.
"""

from __future__ import annotations

from typing import Any

import pytest

from .launch import launch

pytestmark = pytest.mark.distributed
TOL = 1e-5
BASE = {"dropin": True, "p": 2, "m": 4}
SGD_OBJECT = {"how": "object", "opt": "sgd"}

CASES: list[dict[str, Any]] = [
    # LayerSpecs, unseeded: rebuilding them would draw new weights; v-half moves layers 6-7 to rank 0.
    {"name": "pretrained-v-half", "schedule": "v-half", "layerspec": True, "opt": "adamw", **BASE},
    {"name": "pretrained-1f1b", "schedule": "1f1b", "layerspec": True, "opt": "adamw", **BASE},
    {"name": "pretrained-tied-v-half", "schedule": "v-half", "tied": True, "opt": "adamw", **BASE},
    # Groups built from the stock module's named_parameters on each rank; AdamW from the config.
    {"name": "groups-adamw-v-half", "schedule": "v-half", "opt": "adamw", **BASE},
    {"name": "optimizer-object-v-half", "schedule": "v-half", "sched": True, **SGD_OBJECT, **BASE},
    {"name": "optimizer-stepped-refused", "schedule": "v-half", **SGD_OBJECT, "how": "stepped", **BASE},
    {"name": "scheduler-object-refused", "schedule": "v-half", **SGD_OBJECT, "how": "sched_object", **BASE},
    # A Wide first layer: 'parameters' and 'uniform' cut 4 stages differently.
    {"name": "partition-stock-uniform", "schedule": "v-half", "wide": True, "opt": "adamw", **BASE},
    {"name": "partition-stock-inferred", "schedule": "v-half", "wide": True, "opt": "adamw", "forget_method": True, **BASE},
    {"name": "partition-config-wins", "schedule": "v-half", "wide": True, "opt": "adamw",
     "pipeline": {"partition_method": "parameters"}, **BASE},
    # Weights carried and layers profiled inside initialize, before DeepSpeed binds the device.
    {"name": "device-bound-profile-v-half", "schedule": "v-half", "layerspec": True, "opt": "adamw",
     "pipeline": {"partition_method": "profile", "profile_sample": {"inputs": {"shape": [4, 8]}}}, **BASE},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    per_rank = launch(CASES, 2, tmp_path_factory.mktemp("dropin"))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def _assert_trained_like_reference(name: str, ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        assert "error" not in res and "refused" not in res, f"{name} rank {rank}: {res}"
        for got, want in zip(res["losses"], res["ref_losses"]):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{name} rank {rank}: loss {got} vs reference {want}"
        assert res["param_diff"] <= TOL, f"{name} rank {rank}: parameters differ from reference by {res['param_diff']}"
        # Every parameter this rank now owns is optimized, each in the group its name calls for.
        assert res["grouped"] == res["params"], f"{name} rank {rank}: optimized {res['grouped']} of {res['params']}"
        assert res["misplaced"] == [], f"{name} rank {rank}: in the wrong group: {res['misplaced']}"
        assert res["groups"] == 2


@pytest.mark.parametrize("case", ["pretrained-v-half", "pretrained-1f1b", "pretrained-tied-v-half"])
def test_pretrained_weights_carry(results: dict, case: str) -> None:
    _assert_trained_like_reference(case, results[case])


def test_param_groups_keep_their_options_across_moved_layers(results: dict) -> None:
    ranks = results["groups-adamw-v-half"]
    _assert_trained_like_reference("groups-adamw-v-half", ranks)
    assert ranks[0]["local_layers"] == [0, 1, 6, 7]  # rank 0 gained layers 6-7: their groups came from rank 1


def test_optimizer_object_is_rebuilt_with_its_options(results: dict) -> None:
    ranks = results["optimizer-object-v-half"]
    _assert_trained_like_reference("optimizer-object-v-half", ranks)
    for res in ranks:
        assert res["rebuilt"] and res["same_class"] and res["same_defaults"], res
        assert res["lrs"] == [0.05, 0.05]  # the callable scheduler ran on the rebuilt optimizer: 0.2 halved twice


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("optimizer-stepped-refused", ["SGD", "already has state", "pass the optimizer class", "load_checkpoint"]),
        ("scheduler-object-refused", ["StepLR", "bound to an optimizer", "pass a callable", "lr_scheduler=lambda opt"]),
    ],
)
def test_what_cannot_carry_is_refused(results: dict, case: str, needles: list[str]) -> None:
    for rank, res in enumerate(results[case]):
        assert "refused" in res, f"{case} rank {rank} was not refused: {res}"
        for needle in needles:
            assert needle in res["refused"], f"{case} rank {rank}: {needle!r} not in {res['refused']!r}"


def test_stock_partition_method_holds_unless_config_sets_one(results: dict) -> None:
    stock, config = results["partition-stock-uniform"], results["partition-config-wins"]
    _assert_trained_like_reference("partition-stock-uniform", stock)
    _assert_trained_like_reference("partition-stock-inferred", results["partition-stock-inferred"])
    # Noted when the stock module was built, or inferred from its cut: the same.
    assert [r["local_layers"] for r in results["partition-stock-inferred"]] == [r["local_layers"] for r in stock]
    _assert_trained_like_reference("partition-config-wins", config)
    # uniform: 2 layers a stage, V placement [0, 1, 1, 0].
    assert [r["local_layers"] for r in stock] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # parameters: the Wide layer 0 alone in stage 0.
    assert config[0]["local_layers"][0] == 0 and 1 not in config[0]["local_layers"], config[0]["local_layers"]


def test_initialize_binds_the_local_device_before_it_touches_a_tensor(results: dict) -> None:
    # torchrun gives rank r LOCAL_RANK r: every device query inside initialize (weight carry,
    # profiling, then DeepSpeed's own) must see device r, never an unbound (device 0) state.
    ranks = results["device-bound-profile-v-half"]
    _assert_trained_like_reference("device-bound-profile-v-half", ranks)
    for rank, res in enumerate(ranks):
        assert res["device_queries"] == [str(rank)], f"rank {rank} asked for the device while bound to {res['device_queries']}"
