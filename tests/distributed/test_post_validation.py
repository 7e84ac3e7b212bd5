"""Optimizer post-validation on real DeepSpeed engines and gloo ranks.

Two launches, both under the NCCL emulation (eager init: one ordered queue per process group): 2 ranks, and
4 ranks (a 4-stage pipeline, and 2 stages x 2 data-parallel replicas). Consecutive steps
overlap, so a transfer of step k+1 may meet a peer still in step k. Plain gloo runs the same
engine paths in the other distributed tests.

* fp32: every schedule trains 10 steps with post-validation and a clipping threshold (8.5)
  between the steps' gradient norms (about 6.5 to 11 here): some steps stand, others are
  undone and redone clipped. Losses and parameters equal the non-pipelined reference
  (clip_grad_norm_, SGD) within 1e-5; the loss that train_batch returned on ranks without
  the last stage had not arrived when it returned (no broadcast held them).
* fp16 (forced overflows at steps 1, 2, 4, clipping on) and bf16 (an ``inf`` at step 3,
  clipping on): with post-validation every step's overflow flag, skip count, loss scale,
  loss and final parameter equals the same schedule without it.
* Overlap: the last rank holds its optimizer step until rank 0 has started a forward of the
  next step. With post-validation rank 0 gets there (also when the step is redone); without
  it rank 0 waits at the end of train_batch and the hold times out (the control).
"""

from __future__ import annotations

from typing import Any

import pytest

from .launch import ALL_RULES, by_case, launch

pytestmark = pytest.mark.distributed

CLIP = 8.5
CLIP_M8 = 4.0
SCHEDULES_P2 = ["1f1b", "zb-h1", "zb-h2", "v-zb", "v-half"]
SCHEDULES_P4 = ["1f1b", "zb-h2", "v-zb"]
FP16_SCHEDULES = ["1f1b", "v-zb"]
SPECULATED = ["zb-h2", "v-zb"]
POISON_FP16 = [[1, 2, 200.0], [2, 1, 200.0], [4, 3, "inf"]]


def _fp32(schedule: str, p: int) -> dict[str, Any]:
    # m=4 wherever the schedule allows: the same data and model, so the same gradient norms,
    # which CLIP splits; zb-h2 at p=4 needs 7 micro-batches, whose norms CLIP_M8 splits.
    m = 8 if (schedule, p) == ("zb-h2", 4) else 4
    return {"name": f"fp32-{schedule}-p{p}", "post_validation_case": True, "schedule": schedule, "p": p, "m": m,
            "steps": 10, "layers": 8, "clip": CLIP if m == 4 else CLIP_M8}


def _overlap(name: str, p: int, *, on: bool, clip: float, timeout_s: float, **extra: Any) -> dict[str, Any]:
    return {"name": name, "post_validation_case": True, "overlap": True, "post_validation": on, "schedule": "zb-h1" if p == 2
            else "v-zb", "p": p, "m": 2 * p, "layers": 8, "clip": clip, "timeout_s": timeout_s, **extra}


def _spec(case: dict[str, Any], after: int | None = 0) -> dict[str, Any]:
    name = case["name"] + ("-spec" if after is not None else "-nospec")
    return dict(case, name=name, pipeline={**case.get("pipeline", {}), "speculate_after": after}, late_records=True)


def _fp16(schedule: str, on: bool) -> dict[str, Any]:
    return {"name": f"fp16-{schedule}-{'pv' if on else 'plain'}", "fp16": {"initial_scale_power": 13, "loss_scale_window": 2,
            "hysteresis": 1}, "schedule": schedule, "zero": 0, "p": 2, "m": 4, "steps": 10, "layers": 8, "clip": CLIP,
            "poison": POISON_FP16, "pipeline": {"post_validation": on}}


def _cases_p2() -> list[dict[str, Any]]:
    cases = [_fp32(s, 2) for s in SCHEDULES_P2] + [dict(_fp32("v-zb", 2), name="fp32-noclip", clip=0.0)]
    cases += [_spec(_fp32(s, 2)) for s in SPECULATED]
    cases += [_overlap("overlap-on", 2, on=True, clip=100.0, timeout_s=60), _overlap("overlap-redo", 2, on=True, clip=0.05, timeout_s=60),
              _overlap("overlap-off", 2, on=False, clip=100.0, timeout_s=5)]
    stats_hold = _overlap("overlap-stats", 2, on=True, clip=100.0, timeout_s=60, hold_at="stats")
    cases += [_spec(stats_hold), _spec(dict(stats_hold, timeout_s=5), None)]
    cases += [_fp16(s, on) for s in FP16_SCHEDULES for on in (True, False)] + [_spec(_fp16("v-zb", True))]
    cases += [{"name": "bf16-v-zb", "post_validation_case": True, "compare_plain": True, "bf16": True, "schedule": "v-zb", "p": 2,
               "m": 4, "steps": 10, "layers": 8, "clip": CLIP, "poison": [[3, 1]]}]
    return cases


def _cases_p4() -> list[dict[str, Any]]:
    dp2 = dict(_fp32("v-zb", 2), name="fp32-v-zb-dp2")  # 2 stages x 2 data-parallel replicas
    return [_fp32(s, 4) for s in SCHEDULES_P4] + [_spec(_fp32("zb-h2", 4)), dp2, _spec(dp2)] + [
        _overlap("overlap-on-p4", 4, on=True, clip=100.0, timeout_s=60)]



@pytest.fixture(scope="module")
def p2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(_cases_p2(), 2, tmp_path_factory.mktemp("pv2"), nccl="lazy", **ALL_RULES))


@pytest.fixture(scope="module")
def p4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(_cases_p4(), 4, tmp_path_factory.mktemp("pv4"), nccl=True, **ALL_RULES))


def _ok(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"rank {rank}: {r.get('traceback', r['error'])}"
    return ranks


def check_fp32_rank(rank: int, r: dict[str, Any], *, speculated: bool) -> None:
    """One rank of a 10-step fp32 run with clipping: on the reference, and some steps (not all) redone."""
    # Speculated: a step after one that is redone ran twice; otherwise none ran twice.
    assert (r["rerun"] > 0) is speculated, f"rank {rank}: {r['rerun']} reruns"
    assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), f"rank {rank}"
    assert r["param_diff"] < 1e-5, f"rank {rank}: parameters off the reference by {r['param_diff']}"
    redo = [v["redo"] for v in r["verdicts"]]
    assert len(redo) == 10 and 0 < sum(redo) < 10, f"rank {rank}: the threshold must split the steps, got {redo}"
    assert r["redone"] == sum(redo)


def _check_fp32(ranks: list[dict[str, Any]], *, speculated: bool = False) -> None:
    for rank, r in enumerate(_ok(ranks)):
        check_fp32_rank(rank, r, speculated=speculated)
    # Some rank does not hold the last stage (V placement puts it on rank 0): its losses arrived late.
    assert any(not any(r["arrived_before_read"]) for r in ranks)


@pytest.mark.parametrize("schedule", SCHEDULES_P2)
def test_post_validation_matches_the_reference_with_clipped_steps(p2: Any, schedule: str) -> None:
    _check_fp32(p2[f"fp32-{schedule}-p2"])


@pytest.mark.parametrize("schedule", SCHEDULES_P4)
def test_post_validation_matches_the_reference_at_p4_under_nccl_rules(p4: Any, schedule: str) -> None:
    _check_fp32(p4[f"fp32-{schedule}-p4"])


@pytest.mark.parametrize("schedule", SPECULATED)
def test_speculated_steps_match_the_reference(p2: Any, p4: Any, schedule: str) -> None:
    _check_fp32(p2[f"fp32-{schedule}-p2-spec"], speculated=True)
    if schedule == "zb-h2":
        _check_fp32(p4["fp32-zb-h2-p4-spec"], speculated=True)


@pytest.mark.parametrize("name", ["fp32-v-zb-dp2", "fp32-v-zb-dp2-spec"])
def test_post_validation_with_data_parallel_replicas(p4: Any, name: str) -> None:
    _check_fp32(p4[name], speculated=name.endswith("-spec"))


def test_a_speculated_step_starts_before_the_last_rank_sends_its_figures(p2: Any) -> None:
    assert _ok(p2["overlap-stats-spec"])[-1]["waits"] == ["released", "released"]
    assert _ok(p2["overlap-stats-nospec"])[-1]["waits"] == ["timed out", "timed out"]  # the control: waits for the check


def test_without_clipping_fp32_steps_are_never_awaited(p2: Any) -> None:
    for rank, r in enumerate(_ok(p2["fp32-noclip"])):
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5) and r["param_diff"] < 1e-5, f"rank {rank}"
        assert r["verdicts"] == [None] * 10 and r["redone"] == 0  # nothing could be wrong, so nothing was checked


def test_rank0_starts_the_next_step_before_the_last_rank_steps(p2: Any, p4: Any) -> None:
    for name, results in (("overlap-on", p2), ("overlap-redo", p2), ("overlap-on-p4", p4)):
        last = _ok(results[name])[-1]
        assert last["waits"] == ["released", "released"], name


def test_without_post_validation_rank0_waits_for_the_last_rank(p2: Any) -> None:
    # The control: the same hold times out, so the test above can fail.
    assert _ok(p2["overlap-off"])[-1]["waits"] == ["timed out", "timed out"]


@pytest.mark.parametrize("name", [f"fp16-{s}-pv" for s in FP16_SCHEDULES] + ["fp16-v-zb-pv-spec"])
def test_fp16_post_validation_equals_the_plain_engine(p2: Any, name: str) -> None:
    with_pv, plain = _ok(p2[name]), _ok(p2[name.replace("-pv", "-plain").replace("-spec", "")])
    for rank, (a, b) in enumerate(zip(with_pv, plain)):
        assert a["final"]["skipped"] == b["final"]["skipped"] and a["final"]["scale"] == b["final"]["scale"]
        if name.endswith("-spec"):  # per-step flags are read before their check there: compare the outcome
            assert a["rerun"] > 0, f"rank {rank}: no step ran twice"
            assert [s["loss"] for s in a["steps"]] == pytest.approx([s["loss"] for s in b["steps"]], rel=1e-6, nan_ok=True)
            for pname, values in b["params"].items():
                assert a["params"][pname] == pytest.approx(values, rel=1e-6, abs=1e-7), f"rank {rank} {pname}"
            continue
        assert [s["overflow"] for s in a["steps"]] == [s["overflow"] for s in b["steps"]], f"rank {rank}"
        assert sum(s["overflow"] for s in b["steps"]) >= 2, "the poison must overflow"
        assert [s["scale"] for s in a["steps"]] == [s["scale"] for s in b["steps"]]
        assert [s["skipped"] for s in a["steps"]] == [s["skipped"] for s in b["steps"]]
        assert [s["loss"] for s in a["steps"]] == pytest.approx([s["loss"] for s in b["steps"]], rel=1e-6, nan_ok=True)
        for name, values in b["params"].items():
            assert a["params"][name] == pytest.approx(values, rel=1e-6, abs=1e-7), f"rank {rank} {name}"
        assert 0 < a["redone"] < 10, f"rank {rank}: redone {a['redone']} of 10 steps"


def test_bf16_post_validation_equals_the_plain_engine(p2: Any) -> None:
    for rank, r in enumerate(_ok(p2["bf16-v-zb"])):
        plain = r["plain"]
        assert r["skipped"] == plain["skipped"] == 1, f"rank {rank}: the inf step must be skipped"
        assert r["losses"] == pytest.approx(plain["losses"], rel=1e-6, nan_ok=True)
        for name, values in plain["params"].items():
            assert r["params"][name] == pytest.approx(values, rel=1e-6, abs=1e-7), f"rank {rank} {name}"
        redo = [v["redo"] for v in r["verdicts"]]
        assert 0 < sum(redo) < 10 and r["verdicts"][3]["nonfinite"], f"rank {rank}: {redo}"
