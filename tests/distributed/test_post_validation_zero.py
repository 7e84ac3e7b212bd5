"""Optimizer post-validation with ZeRO-1 and ZeRO-2, on 2 stages x 2 data-parallel replicas.

Two launches of 4 real gloo ranks: one under the NCCL emulation's default mode (eager unless
DS_VSHAPE_TEST_NCCL says otherwise), one under its lazy mode. DeepSpeed's ZeRO optimizer
(DeepSpeedZeroOptimizer) steps on each rank's owned partition, so the check's gradient norm
is summed over the shards (data parallel, then the pipeline) and a redo restores the shards.

* fp32, SGD with momentum (so the optimizer state shard matters): 10 steps with a clipping
  threshold between the steps' global norms, so some steps stand and others are undone and
  redone clipped, waiting for the check and speculating. Losses and parameters equal the
  non-pipelined reference within 1e-5, and equal the same schedule without post-validation
  exactly (bit for bit: the optimistic step that stands and the redo are DeepSpeed's own step).
* fp16 (dynamic loss scale, forced overflows at steps 1, 2 and 4, clipping on): with
  post-validation every step's overflow flag, skip count, loss scale, loss and final parameter
  equals the same schedule without it. Under ZeRO-2 only data-parallel replica 0 sees the bad
  micro-batches, so the inf reaches one shard of one replica only and still skips every rank.
"""

from __future__ import annotations

from typing import Any

import pytest

from .launch import ALL_RULES, by_case, launch
from .test_post_validation import check_fp32_rank

pytestmark = pytest.mark.distributed

CLIP = 3.0  # between the steps' global norms (about 1.2 to 8.7 with this momentum): 4 of 10 steps redone
MOMENTUM = 0.5
POISON_FP16 = [[1, 2, 200.0], [2, 1, 200.0], [4, 3, "inf"]]


def _fp32(zero: int, schedule: str, *, spec: bool = False) -> dict[str, Any]:
    name = f"fp32-z{zero}-{schedule}" + ("-spec" if spec else "")
    case = {"name": name, "post_validation_case": True, "schedule": schedule, "zero": zero, "p": 2, "m": 4, "steps": 10,
            "layers": 8, "clip": CLIP, "momentum": MOMENTUM}
    if spec:
        return dict(case, pipeline={"speculate_after": 0}, late_records=True)
    return dict(case, compare_plain=True)


def _fp16(zero: int, schedule: str, *, on: bool, spec: bool = False, **extra: Any) -> dict[str, Any]:
    name = f"fp16-z{zero}-{schedule}-{'pv' if on else 'plain'}" + ("-spec" if spec else "")
    pipeline: dict[str, Any] = {"post_validation": on, **({"speculate_after": 0} if spec else {})}
    return {"name": name, "fp16": {"initial_scale_power": 13, "loss_scale_window": 2, "hysteresis": 1}, "schedule": schedule,
            "zero": zero, "p": 2, "m": 4, "steps": 10, "layers": 8, "clip": CLIP, "poison": POISON_FP16, "pipeline": pipeline,
            "late_records": spec, **extra}


def _cases() -> list[dict[str, Any]]:
    cases = [_fp32(z, "v-zb", spec=spec) for z in (1, 2) for spec in (False, True)]
    for zero, extra in ((1, {}), (2, {"poison_dp_rank": 0})):
        cases += [_fp16(zero, "1f1b", on=True, **extra), _fp16(zero, "1f1b", on=False, **extra),
                  _fp16(zero, "1f1b", on=True, spec=True, **extra)]
    return cases


def _lazy_cases() -> list[dict[str, Any]]:
    return [_fp32(2, "zb-h1"), _fp32(1, "zb-h1", spec=True)]



@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(_cases(), 4, tmp_path_factory.mktemp("pvz")))


@pytest.fixture(scope="module")
def lazy_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(_lazy_cases(), 4, tmp_path_factory.mktemp("pvz-lazy"), nccl="lazy", **ALL_RULES))


def _ok(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"rank {rank}: {r.get('traceback', r['error'])}"
        assert r["optimizer"] == "DeepSpeedZeroOptimizer", f"rank {rank}: {r['optimizer']}"
    return ranks


def _check_fp32(ranks: list[dict[str, Any]], *, speculated: bool, plain: list[dict[str, Any]]) -> None:
    for rank, (r, base) in enumerate(zip(_ok(ranks), plain)):
        check_fp32_rank(rank, r, speculated=speculated)
        # Bit for bit what the same engine gives without post-validation.
        assert r["losses"] == base["losses"], f"rank {rank}"
        assert r["params"] == base["params"], f"rank {rank}"
    assert any(not any(r["arrived_before_read"]) for r in ranks)  # a rank without the last stage got its loss late


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("spec", [False, True], ids=["waiting", "speculating"])
def test_zero_post_validation_matches_the_reference_and_the_plain_engine(runs: Any, zero: int, spec: bool) -> None:
    plain = [r["plain"] for r in _ok(runs[f"fp32-z{zero}-v-zb"])]
    _check_fp32(runs[f"fp32-z{zero}-v-zb" + ("-spec" if spec else "")], speculated=spec, plain=plain)


def test_zero_post_validation_under_lazy_nccl_rules(lazy_runs: Any) -> None:
    _check_fp32(lazy_runs["fp32-z2-zb-h1"], speculated=False, plain=[r["plain"] for r in lazy_runs["fp32-z2-zb-h1"]])
    for rank, r in enumerate(_ok(lazy_runs["fp32-z1-zb-h1-spec"])):
        assert r["rerun"] > 0 and r["param_diff"] < 1e-5, f"rank {rank}: {r['rerun']} reruns, {r['param_diff']}"
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), f"rank {rank}"


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("spec", [False, True], ids=["waiting", "speculating"])
def test_zero_fp16_post_validation_equals_the_plain_engine(runs: Any, zero: int, spec: bool) -> None:
    name = f"fp16-z{zero}-1f1b-pv" + ("-spec" if spec else "")
    with_pv, plain = runs[name], runs[f"fp16-z{zero}-1f1b-plain"]
    for rank, (a, b) in enumerate(zip(_ok(with_pv), _ok(plain))):
        assert a["final"]["skipped"] == b["final"]["skipped"] and a["final"]["scale"] == b["final"]["scale"], f"rank {rank}"
        assert a["params"] == b["params"], f"rank {rank}"  # bit for bit
        assert [s["loss"] for s in a["steps"]] == pytest.approx([s["loss"] for s in b["steps"]], rel=1e-6, nan_ok=True)
        if spec:  # per-step flags are read before their check there: compare the outcome
            assert a["rerun"] > 0, f"rank {rank}: no step ran twice"
            continue
        assert sum(s["overflow"] for s in b["steps"]) >= 2, "the poison must overflow"
        for key in ("overflow", "scale", "skipped"):
            assert [s[key] for s in a["steps"]] == [s[key] for s in b["steps"]], f"rank {rank} {key}"
        assert 0 < a["redone"] < 10, f"rank {rank}: redone {a['redone']} of 10 steps"
