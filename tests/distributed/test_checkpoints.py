"""Checkpoints cross schedules and pipeline sizes with the optimizer state; what cannot cross is refused.

The resume chain of issue 10: AdamW with weight decay and DeepSpeed's WarmupLR, v-half at p=4
for 3 steps, save; 1f1b at p=2 loads it, 3 steps, save; zb-h1 at p=4 loads that, 3 steps.
Each launch is a separate job (4, 2, 4 ranks) on one shared directory; each link
compares its losses, parameters and Adam moments with a plain model trained from the start
(fp32, 1e-5). The 2-rank launch also runs the stock-DeepSpeed and refusal cases, and the
damaged-checkpoint case: a save cut off, a missing rank's file, cut-off, changed and foreign
files and a layout file of another version, each refused on every rank before anything loads;
and the exact-resume case (resume_checks.py): a job restarted from its step-2 tag under auto,
post-validation, the w_memory fit and fp16 equals the uninterrupted job, files bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ds_vshape.runtime.dropin.integrity import tag_problems
from ds_vshape.runtime.dropin.layout_file import CheckpointError, read_layout

from .launch import launch, process_alive

pytestmark = pytest.mark.distributed
TOL = 1e-5
CHAIN = [("v-half", 4), ("1f1b", 2), ("zb-h1", 4)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("ckpt")
    chain_dir = str(tmp / "chain")
    out: dict[str, list[dict[str, Any]]] = {}
    for phase, (schedule, p) in enumerate(CHAIN):
        cases = [{"name": f"chain-{phase}", "ckpt_case": "chain", "phase": phase, "schedule": schedule, "p": p, "m": 4,
                  "dir": chain_dir}]
        if p == 2:  # the other cases ride along with the 2-rank launch
            cases += [{"name": "stock", "ckpt_case": "stock", "p": 2, "m": 4, "schedule": None, "dir": str(tmp / "stock")},
                      {"name": "zero1", "ckpt_case": "zero1", "p": 2, "m": 4, "schedule": None, "dir": str(tmp / "zero1")},
                      {"name": "damaged", "ckpt_case": "damaged", "p": 2, "m": 4, "dir": str(tmp / "damaged")},
                      {"name": "resume", "ckpt_case": "resume", "p": 2, "m": 4, "dir": str(tmp / "resume")}]
        per_rank = launch(cases, p, tmp / f"launch{phase}")
        out.update({name: [r[name] for r in per_rank] for name in per_rank[0]})
    return out


def _ok(name: str, ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        assert "error" not in res, f"{name} rank {rank}: {res.get('error')}\n{res.get('traceback', '')}"


@pytest.mark.parametrize("phase", range(len(CHAIN)))
def test_resume_chain_matches_one_uninterrupted_run(results: dict, phase: int) -> None:
    name = f"chain-{phase}"
    ranks = results[name]
    _ok(name, ranks)
    for rank, res in enumerate(ranks):
        assert res["optimizer"] == "AdamW", res["optimizer"]  # torch's, under no wrapper: the mapped kind
        assert res["loaded_global_steps"] == 3 * phase, f"{name} rank {rank}: global step {res['loaded_global_steps']}"
        for got, want in zip(res["losses"], res["ref_losses"], strict=True):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{name} rank {rank}: loss {got} vs reference {want}"
        assert res["param_diff"] <= TOL, f"{name} rank {rank}: parameters differ from reference by {res['param_diff']}"
        assert res["state_diff"] <= TOL, f"{name} rank {rank}: Adam moments differ from reference by {res['state_diff']}"
        assert res["adam_steps"] == [[3.0 * (phase + 1)] * 2], res["adam_steps"]  # JSON: lists


def test_chain_really_moves_layers_between_ranks(results: dict) -> None:
    layers = [[r["local_layers"] for r in results[f"chain-{k}"]] for k in range(len(CHAIN))]
    assert layers[0][0] == [0, 7] and layers[1][0] == [0, 1, 2, 3] and layers[2][3] == [6, 7], layers


def test_stock_deepspeed_checkpoint_resumes_under_the_same_placement(results: dict) -> None:
    ranks = results["stock"]
    _ok("stock", ranks)
    for rank, res in enumerate(ranks):
        assert res["state_diff"] == 0.0 and res["global_steps"] == 2, f"rank {rank}: {res}"
        stock_loss, our_loss = res["losses"]
        assert abs(stock_loss - our_loss) <= TOL and res["param_diff"] <= TOL, f"rank {rank}: {res}"


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("stock", ["stock DeepSpeed (1f1b) at p=2", "schedule 'v-half' at p=2", "parameter order", "wrong layers",
                   "load_optimizer_states=False", "2 pipeline stages"]),
        ("zero1", ["schedule '1f1b' at p=2", "schedule 'v-half' at p=2", "ZeRO stage 1", "flat per-rank buffers",
                   "load_optimizer_states=False", "pipeline.schedule='1f1b'"]),
    ],
)
def test_cross_placement_optimizer_load_is_refused_with_what_to_do(results: dict, case: str, needles: list[str]) -> None:
    for rank, res in enumerate(results[case]):
        assert "error" not in res, res
        assert res["refused"] is not None, f"{case} rank {rank}: loaded without refusal"
        for needle in needles + [f"rank {rank}:"]:
            assert needle in res["refused"], f"{case} rank {rank}: {needle!r} not in {res['refused']!r}"
        assert res["weights_only_error"] is None, f"{case} rank {rank}: weights-only load failed: {res['weights_only_error']}"


def test_weights_only_load_under_zero1_takes_weights_and_step(results: dict) -> None:
    for rank, res in enumerate(results["zero1"]):
        assert res["weight_diff"] == 0.0 and res["loaded_global_steps"] == 1, f"rank {rank}: {res}"


def test_a_different_layer_count_is_refused(results: dict) -> None:
    for rank, res in enumerate(results["zero1"]):
        msg = res["layers_refused"]
        assert msg is not None and "8 layers" in msg and "has 10" in msg, f"rank {rank}: {msg!r}"


def test_a_save_records_every_file_and_names_itself_latest_last(results: dict) -> None:
    for rank, res in enumerate(results["damaged"]):
        assert "error" not in res, res
        assert res["latest"] == "t2" and res["leftovers"] == ["vs_layout.json"], f"rank {rank}: {res}"
        assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "vs_optim_pp_rank_00.pt",
                "vs_optim_pp_rank_01.pt", "layer_00-model_states.pt", "layer_07-model_states.pt"} <= set(res["recorded"])


@pytest.mark.parametrize(
    ("copy", "needles"),
    [
        ("cut", ["cut cannot be loaded", "the save of this tag did not finish", "vs_saving"]),
        ("missing", ["vs_optim_pp_rank_01.pt is missing (the save wrote"]),
        ("truncated", ["layer_05-model_states.pt has 100 bytes where the save wrote"]),
        ("flipped", ["mp_rank_00_model_states.pt differs from what the save wrote"]),
        ("foreign", ["layer_02-model_states.pt", "another checkpoint's file"]),
        ("version", ["vs_layout.json has format 'ds_vshape.checkpoint/99'", "with the ds_vshape version that wrote it"]),
        ("latest", ["missing cannot be loaded", "vs_optim_pp_rank_01.pt is missing"]),  # latest names a damaged tag
    ],
)
def test_a_damaged_checkpoint_is_refused_on_every_rank_naming_the_file(results: dict, copy: str, needles: list[str]) -> None:
    for rank, res in enumerate(results["damaged"]):
        msg = res["refused"][copy]
        assert msg is not None and msg.startswith(f"CheckpointError: rank {rank}: checkpoint "), f"rank {rank}: {msg!r}"
        for needle in needles + ["Nothing was loaded, on any rank", "tag='t2'"]:
            assert needle in msg, f"{copy} rank {rank}: {needle!r} not in {msg!r}"


def test_after_the_refusals_nothing_changed_and_the_last_finished_tag_resumes(results: dict) -> None:
    for rank, res in enumerate(results["damaged"]):
        assert res["untouched"] and res["resume_error"] is None and res["resumed_step"] == 2, f"rank {rank}: {res}"


def test_a_restarted_job_continues_exactly_as_the_uninterrupted_one(results: dict) -> None:
    """auto, post-validation speculating, the w_memory fit, fp16 loss scaling: resumed from step 2,
    the same losses, the same step-4 files bit for bit, and the runtime state the save had."""
    for rank, res in enumerate(results["resume"]):
        assert "error" not in res, f"rank {rank}: {res.get('error')}\n{res.get('traceback', '')}"
        uninterrupted, resumed = res["losses"]
        assert resumed == uninterrupted, f"rank {rank}: steps 3-4 {resumed} after the resume, {uninterrupted} without"
        assert res["compared"] > 100 and res["differ"] == [], f"rank {rank}: step-4 tags differ in {res['differ'][:8]}"
        at_save, after_load = res["at_save"], res["after_load"]
        # auto's pick rests on measured pass times (v-zb here): any V schedule, as the placement asks
        assert str(at_save["auto"]).startswith("v-") and at_save["streak"] >= 1 and at_save["fit"], f"rank {rank}: {at_save}"
        for key in ("auto", "schedule", "streak", "scale", "rng", "python_rng"):
            assert after_load[key] == at_save[key], f"rank {rank}: {key} {after_load[key]!r} loaded, {at_save[key]!r} saved"
        assert res["end"][0] == res["end"][1], f"rank {rank}: at step 4 {res['end'][1]} resumed, {res['end'][0]} without"
        assert res["end"][0]["fit_on_schedule"], f"rank {rank}: the fit kept the measuring schedule's limit: {res['end']}"
        assert res["skipped"] == [1, 1] and res["end"][0]["scale"] != at_save["scale"], f"rank {rank}: {res}"


def test_a_rank_killed_inside_a_save_leaves_latest_on_the_last_finished_tag(tmp_path: Path) -> None:
    """Rank 1 dies by SIGKILL in the save of t2, right after writing its optimizer file; the launcher stops rank 0.
    A new launch then resumes from ``latest``: exactly the state the job had at t1, and the same step 2."""
    root = tmp_path / "killed"
    case = {"name": "killed", "ckpt_case": "killed", "p": 2, "m": 4, "dir": str(root), "killed_rank": 1}
    with pytest.raises(RuntimeError, match="ranks exited"):
        launch([case], 2, tmp_path / "launch", timeout=120)
    took = time.time() - float((root / "killed_at").read_text())
    pids = [int((root / "pids" / str(r)).read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(process_alive(pid) for pid in pids), f"ranks still running: {pids}"
    assert took < 30, f"the launch ended {took:.0f} s after the kill"
    assert (root / "latest").read_text() == "t1"
    assert (root / "t2" / "vs_optim_pp_rank_01.pt").is_file() and not (root / "t2" / "vs_layout.json").exists()
    with pytest.raises(CheckpointError, match="did not finish"):
        read_layout(str(root / "t2"))
    saved, found = tag_problems(str(root / "t1"), rank=0, world=1)  # every file of t1 as its save recorded it
    assert saved is not None and saved.files and found == [], found
    # A new launch resumes from latest (t1): the killed job's state there exactly, and the same step 2.
    reload = dict(case, name="reload", ckpt_case="reload")
    for rank, res in enumerate(r["reload"] for r in launch([reload], 2, tmp_path / "reload", timeout=120)):
        assert "error" not in res, f"rank {rank}: {res.get('error')}\n{res.get('traceback', '')}"
        assert res["compared"] > 0 and res["differ"] == [], f"rank {rank}: differ from the state saved at t1: {res['differ']}"
        assert res["global_steps"] == [1, 1] and res["lr"][0] == res["lr"][1], f"rank {rank}: {res}"
        assert res["loss_step2"][0] == res["loss_step2"][1], f"rank {rank}: step 2 after the resume: {res['loss_step2']}"
