"""Batch keys resolved as DeepSpeed resolves them, batch ramp-up, and eval_batch with any m.

One launch at 2 ranks; every case against the plain reference (fp32, 1e-5).
"""

from __future__ import annotations

from typing import Any

import pytest

from .launch import by_case, launch
from .test_engine import TOL, _assert_parity

pytestmark = pytest.mark.distributed
ROWS = 4  # worker.ROWS: rows per micro-batch

BATCH_CASES = [
    # train_batch_size and the micro-batch size: DeepSpeed derives 6 micro-batches per step.
    {"name": "tbs-micro-v-half", "batch_check": "batch_keys", "schedule": "v-half", "p": 2, "m": 6,
     "batch": {"train_batch_size": 6 * ROWS, "train_micro_batch_size_per_gpu": ROWS}},
    # train_batch_size and gradient_accumulation_steps: the micro-batch size is derived.
    {"name": "tbs-gas-zb-h1", "batch_check": "batch_keys", "schedule": "zb-h1", "p": 2, "m": 4,
     "batch": {"train_batch_size": 4 * ROWS, "gradient_accumulation_steps": 4}},
    # Only train_batch_size (as DeepSpeed's own pipeline tests do): one micro-batch per step.
    {"name": "tbs-only-1f1b", "batch_check": "batch_keys", "schedule": "1f1b", "p": 2, "m": 1,
     "batch": {"train_batch_size": ROWS}},
    # Ramp-up (and down); then a size below the schedule's minimum (zb-h2 needs 3 at p=2,
    # interleaved 2), which must be refused and leave the last size in place.
    {"name": "ramp-zb-h2", "batch_check": "ramp", "schedule": "zb-h2", "p": 2, "m": 3, "m2": 6, "too_few": 2},
    {"name": "ramp-interleaved", "batch_check": "ramp", "schedule": "interleaved", "p": 2, "m": 6, "m2": 4, "too_few": 1},
]
EVAL_CASES = [
    {"name": f"eval-{s}", "batch_check": "eval_any_m", "schedule": s, "p": 2, "m": 4, "eval_m": [1, 3, 5]}
    for s in ("1f1b", "v-half", "interleaved", "zb-h2")
] + [
    # DeepSpeed's activation checkpointing with partitioned activations, as in its own
    # pipeline tests; last, since it configures the checkpointing module for the process.
    {"name": "eval-ckpt-partitioned-v-half", "batch_check": "eval_any_m", "schedule": "v-half", "p": 2, "m": 4,
     "eval_m": [2, 4], "layerspec": True, "ckpt": 1, "partition_activations": True},
]


GROUP_CASES = [{"name": f"groups-{s}", "batch_check": "groups", "schedule": s, "p": 2, "m": 4, "tied": tied}
               for s, tied in (("v-half", False), ("zb-h1", False), ("v-half", True))]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(GROUP_CASES + BATCH_CASES + EVAL_CASES, 2, tmp_path_factory.mktemp("batch")))


@pytest.mark.parametrize("case", [c["name"] for c in GROUP_CASES])
def test_the_recut_module_reuses_the_stock_grid_and_frees_its_layers(results: dict, case: str) -> None:
    for rank, res in enumerate(results[case]):
        assert "error" not in res, f"{case} rank {rank}: {res['error']}\n{res.get('traceback', '')}"
        # No second grid: the engine runs on the stock module's grid, and initialize adds far
        # fewer groups than building a grid does: one extra group (see the issue note) and the
        # transfers' 2-rank group per neighbour pair (p=2, one pipeline: one pair).
        groups, pair_groups = res["groups"], 1
        assert res["same_grid"] and groups["ds_vshape"] <= groups["deepspeed"] + 1 + pair_groups < groups["stock_module"], groups
        assert res["stock_layers_left"] == [], res


@pytest.mark.parametrize("case", [c for c in BATCH_CASES if c["batch_check"] == "batch_keys"], ids=lambda c: c["name"])
def test_batch_keys_resolve_like_deepspeed(results: dict, case: dict[str, Any]) -> None:
    _assert_parity(case["name"], results[case["name"]])
    for res in results[case["name"]]:
        assert res["micro_batches"] == res["schedule_m"] == case["m"], res


@pytest.mark.parametrize("case", [c for c in BATCH_CASES if c["batch_check"] == "ramp"], ids=lambda c: c["name"])
def test_set_train_batch_size_regenerates_the_schedule(results: dict, case: dict[str, Any]) -> None:
    _assert_parity(case["name"], results[case["name"]])
    for res in results[case["name"]]:
        assert res["schedule_m"] == res["micro_batches"] == case["m2"], res
        assert res["refused"] and f"set_train_batch_size({ROWS * case['too_few']})" in res["refused"], res["refused"]
        assert f"stays {ROWS * case['m2']}" in res["refused"], res["refused"]


@pytest.mark.parametrize("case", [c["name"] for c in EVAL_CASES])
def test_eval_batch_with_any_number_of_micro_batches(results: dict, case: str) -> None:
    for rank, res in enumerate(results[case]):
        assert "error" not in res, f"{case} rank {rank}: {res['error']}\n{res.get('traceback', '')}"
        for got, want in zip(res["eval"], res["ref_eval"]):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), (case, rank, res["eval"], res["ref_eval"])
