"""3D jobs: pipeline x tensor-parallel (x data-parallel) against a non-sharded model.

A 4-rank launch runs PP2 x TP2 under every runtime schedule, and a checkpoint saved under
v-half and resumed under 1f1b; an 8-rank launch runs PP2 x TP2 x DP2 under 1f1b, zb-h1 and
v-half, and v-half with ZeRO-1 and zb-h1 with ZeRO-2. The model's layers are Megatron-style
column/row-parallel linears (custom autograd Functions with the all-reduces, see
tp_checks.py); after 2 steps with clipping active every shard equals its slice of the
reference, and the losses equal the reference's (fp32, 1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ds_vshape.schedules import get_info, schedule_names

from .launch import launch

pytestmark = pytest.mark.distributed
TOL = 1e-5
# seq1f1b needs attention-aware chunking; everything else runs here (as in test_engine.py).
PP2_TP2 = [n for n in schedule_names() if n != "seq1f1b"]
PP2_TP2_DP2 = ["1f1b", "zb-h1", "v-half"]
POST_VALIDATED = ["1f1b", "v-half"]  # the check's norm and verdict span pipeline and tensor-parallel ranks
ZERO = [("v-half", 1), ("zb-h1", 2)]  # ZeRO-1/2 partition over the data-parallel replicas (DP2)


def _m(name: str) -> int:
    info = get_info(name)
    return max(info.min_micro_batches(2, info.chunks(None), 1), 4)


def _case(name: str, tag: str, *, dp: int = 1) -> dict[str, Any]:
    # All three batch keys, as a user's config has them: they must fit dp replicas, not world / p.
    batch = {"train_batch_size": 4 * _m(name) * dp}  # 4: worker.ROWS, the micro-batch size
    return {"name": f"{tag}-{name}", "tp": 2, "p": 2, "m": _m(name), "schedule": name, "extra_config": batch}


def _run(cases: list[dict[str, Any]], nproc: int, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    per_rank = launch(cases, nproc, tmp)
    return {c["name"]: [r[c["name"]] for r in per_rank] for c in cases}


def _ckpt_case(tmp: Path) -> dict[str, Any]:
    """v-half saves after 2 steps (SGD with momentum: optimizer state to map), 1f1b loads and trains a third."""
    sgd = {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}}
    return {"name": "pp2tp2-ckpt", "tp": 2, "p": 2, "m": 4, "schedule": "v-half", "momentum": 0.9,
            "extra_config": {"optimizer": sgd}, "ckpt": {"dir": str(tmp / "ckpt"), "load_as": "1f1b"}}


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("pp2tp2")
    post = [dict(_case(n, "pp2tp2-pv"), steps=3, pipeline={"post_validation": True}) for n in POST_VALIDATED]
    eager = [dict(_case("v-half", "pp2tp2-eager"), eager=True)]  # Megatron's linear: every gradient on every call
    return _run([_case(n, "pp2tp2") for n in PP2_TP2] + [_ckpt_case(tmp)] + post + eager, 4, tmp)


@pytest.fixture(scope="module")
def pp2_tp2_dp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    zero = [dict(_case(n, f"pp2tp2dp2-zero{z}", dp=2), zero=z) for n, z in ZERO]
    return _run([_case(n, "pp2tp2dp2", dp=2) for n in PP2_TP2_DP2] + zero, 8, tmp_path_factory.mktemp("pp2tp2dp2"))


def _check_losses(name: str, rank: int, res: dict[str, Any]) -> None:
    for got, want in zip(res["losses"], res["ref_losses"], strict=True):
        assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{name} rank {rank}: loss {got} vs reference {want}"


def _check(name: str, ranks: list[dict[str, Any]], *, dp: int, losses_on_last_only: bool = False) -> None:
    for rank, res in enumerate(ranks):
        assert "error" not in res, f"{name} rank {rank}: {res.get('error')}\n{res.get('traceback', '')}"
        assert (res["dp"], res["tp"]) == (dp, 2), f"{name} rank {rank}: dp={res['dp']} tp={res['tp']}"
        # Post-validation does not broadcast the loss: only the loss stage's ranks hold it.
        if res["last"] or not losses_on_last_only:
            _check_losses(name, rank, res)
        assert res["param_diff"] <= TOL, f"{name} rank {rank}: shards differ from the reference by {res['param_diff']}"
        peers = [tuple(c) for c in res["p2p_peers"]]  # transfers stay within one (data, tensor-parallel) coordinate
        assert len(peers) == 1, f"{name} rank {rank}: transfers reach (data, model) coordinates {peers}"
    # Every rank of the job reports the same global norm (pipeline and tensor ranks summed).
    norms = {round(r["global_norm"], 9) for r in ranks}
    assert len(norms) == 1, f"{name}: ranks disagree on the global norm: {norms}"


@pytest.mark.parametrize("schedule", PP2_TP2)
def test_pp2_tp2_equals_the_unsharded_model(pp2_tp2: dict, schedule: str) -> None:
    _check(f"pp2tp2-{schedule}", pp2_tp2[f"pp2tp2-{schedule}"], dp=1)


@pytest.mark.parametrize("schedule", PP2_TP2_DP2)
def test_pp2_tp2_dp2_equals_the_unsharded_model(pp2_tp2_dp2: dict, schedule: str) -> None:
    _check(f"pp2tp2dp2-{schedule}", pp2_tp2_dp2[f"pp2tp2dp2-{schedule}"], dp=2)


def test_pp2_tp2_checkpoint_crosses_schedules_per_tensor_parallel_rank(pp2_tp2: dict) -> None:
    ranks = pp2_tp2["pp2tp2-ckpt"]
    _check("pp2tp2-ckpt", ranks, dp=1)  # 2 steps under v-half, 1 under 1f1b after the load: the reference's 3
    assert all(r["loaded_schedule"] == "1f1b" and len(r["losses"]) == 3 for r in ranks)
    files = ranks[0]["ckpt_files"]
    optim = [f"vs_optim_pp_rank_{p:02d}_tp_rank_{t:02d}.pt" for p in range(2) for t in range(2)]
    assert set(optim) <= set(files), files  # named optimizer state per pipeline and tensor-parallel rank
    layers = [f for f in files if f.startswith("layer_")]
    assert layers and all("-model_00-" in f or "-model_01-" in f for f in layers), layers
    assert len(layers) == 2 * len({f.split("-")[0] for f in layers}), layers  # each layer once per tensor-parallel rank


@pytest.mark.parametrize(("schedule", "zero"), ZERO)
def test_pp2_tp2_dp2_with_zero_equals_the_unsharded_model(pp2_tp2_dp2: dict, schedule: str, zero: int) -> None:
    name = f"pp2tp2dp2-zero{zero}-{schedule}"
    _check(name, pp2_tp2_dp2[name], dp=2)


@pytest.mark.parametrize("schedule", POST_VALIDATED)
def test_pp2_tp2_post_validated_equals_the_unsharded_model(pp2_tp2: dict, schedule: str) -> None:
    _check(f"pp2tp2-pv-{schedule}", pp2_tp2[f"pp2tp2-pv-{schedule}"], dp=1, losses_on_last_only=True)


def test_pp2_tp2_linear_computing_every_gradient_runs_whole_in_b_and_equals(pp2_tp2: dict) -> None:
    """A parallel linear whose backward computes the weight gradient anyway (Megatron's) is kept
    whole in B by split backward; the 3D job still equals the reference."""
    _check("pp2tp2-eager-v-half", pp2_tp2["pp2tp2-eager-v-half"], dp=1)
