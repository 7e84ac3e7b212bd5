"""DeepSpeed's own pipeline unit tests, re-expressed and run under several ds_vshape schedules.

One launch at 2 ranks; the checks live in ported_checks.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from .launch import by_case, launch

pytestmark = pytest.mark.distributed

SCHEDULES = ["1f1b", "zb-h1", "v-half", "v-zb", "interleaved"]
CASES = (
    [{"name": f"gas-{s}", "ported": "gas_scaling", "schedule": s, "m": 4} for s in SCHEDULES]
    + [{"name": f"shapes-{s}", "ported": "dynamic_shapes", "schedule": s, "m": 4} for s in ("1f1b", "zb-h1", "v-min")]
    + [{"name": f"sequential-{s}", "ported": "sequential_eval", "schedule": s, "m": 4} for s in ("1f1b", "v-half", "zb-h2")]
    # Last: DeepSpeed's checkpointing configuration is global to the process.
    + [{"name": f"sequential-ckpt-{s}", "ported": "sequential_eval", "schedule": s, "ckpt": True} for s in ("1f1b", "v-half")]
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(CASES, 2, tmp_path_factory.mktemp("ported")))


def _ok(name: str, res: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in res, f"{name}: {res['error']}\n{res.get('traceback', '')}"
    return res


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradient_accumulation_scales_the_loss_once(results: dict, schedule: str) -> None:
    for res in results[f"gas-{schedule}"]:
        assert _ok(schedule, res)["weights"] and all(abs(w - 0.8) < 1e-6 for w in res["weights"]), res["weights"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "v-min"])
def test_micro_batches_of_changing_shapes_train(results: dict, schedule: str) -> None:
    for res in results[f"shapes-{schedule}"]:
        assert all(math.isfinite(loss) for loss in _ok(schedule, res)["losses"])
        assert res["shapes_seen"] and all(n > 1 for n in res["shapes_seen"]), res["shapes_seen"]


@pytest.mark.parametrize("name", [c["name"] for c in CASES if c["ported"] == "sequential_eval"])
def test_pipeline_module_equals_the_sequential_model(results: dict, name: str) -> None:
    for res in results[name]:
        assert _ok(name, res)["params"] == res["base_params"]
        assert res["max_diff"] <= 1e-5, (name, res)
