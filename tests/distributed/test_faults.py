"""A rank killed mid-step: every survivor exits non-zero within p2p_timeout_s, naming what it waited for.

Each case runs its 4 ranks as independent processes (fault_driver.py forks them side by side,
as on 4 nodes: no launcher stops the survivors), under the launches' NCCL emulation. In train
step 2, pipeline rank 2 (p=4) or global rank 2 (PP2xDP2: stage 1 of the first replica) dies by
SIGKILL at one point of the step: as it starts a forward (F), a backward (B; 1f1b's fused
one), a weight pass (W; schedules that split backward), right after it posts a send (before
the peer's receive completes), or as it enters the optimizer step. Its sockets stay open (a
forked holder keeps them), so the survivors learn nothing from a closed connection, as under
NCCL. Each survivor must end with exit status 1 within ``TIMEOUT_S + MARGIN_S`` of the recorded
kill, its last error naming its pipeline and global rank, the step, and the transfer or the
collective it was waiting for; no rank may be left running.

Four more cases under PP2xDP2 and v-zb: ZeRO-1 (B, step) and post-validation speculating (F,
step; a death in the optimistic step 2 is found in step 3, whose error names it). Four
cases run again under every NCCL rule (lazy init, first contact, synchronize, one queue per
rank: ``-all-rules``), whatever the launch's rules: there a collective queues behind a send to
the dead rank, and post-validation's check, issued in one step, is waited for in the next.

All cases share one driver process (imports once) and run ``CONCURRENT`` at a time: most of a
case is its survivors' wait, so running them side by side keeps the suite's added time small.
The table of times to exit is written to the launch directory (``exit_times.md``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .launch import ALL_RULES, ROOT, default_mode, emulation_env, process_alive, run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT_S = 4.0  # the cases' p2p_timeout_s
MARGIN_S = 5.0  # what a survivor may take beyond it (work left after the kill, load of the other cases)
CONCURRENT = 6
AFTER_KILL_S = 30.0  # a survivor still running this long after the kill is a hang: its stacks are taken, it is ended
KILL_RANK = 2
SHAPES = {"p4": (4, 8), "pp2xdp2": (2, 4)}  # p, m; 4 ranks each
SCHEDULES = ("1f1b", "zb-h2", "v-zb", "interleaved")
SPLIT = ("zb-h2", "v-zb")  # the schedules with W passes
POINTS = ("F", "B", "W", "send", "step")
NAMED = ("P2PTimeoutError", "P2PError", "StepCollectiveError")


def _cases() -> list[dict[str, Any]]:
    cases = []
    for shape, (p, m) in SHAPES.items():
        for schedule in SCHEDULES:
            for point in POINTS:
                if point == "W" and schedule not in SPLIT:
                    continue
                cases.append({"name": f"{shape}-{schedule}-{point}", "schedule": schedule, "p": p, "world": 4, "m": m,
                              "steps": 3, "kill_step": 2, "kill_mb": 1, "kill_rank": KILL_RANK, "point": point,
                              "pipeline": {"p2p_timeout_s": TIMEOUT_S}})
    return cases


def _extra_cases() -> list[dict[str, Any]]:
    """ZeRO-1 (its own reductions) and post-validation (its check arrives in the next step) under PP2xDP2."""
    base = {"p": 2, "world": 4, "m": 4, "steps": 3, "kill_step": 2, "kill_mb": 1, "kill_rank": KILL_RANK}
    pv = {"p2p_timeout_s": TIMEOUT_S, "post_validation": True, "speculate_after": 1}
    return [
        {**base, "name": "pp2xdp2-zero1-v-zb-B", "schedule": "v-zb", "zero": 1, "point": "B",
         "pipeline": {"p2p_timeout_s": TIMEOUT_S}},
        {**base, "name": "pp2xdp2-zero1-v-zb-step", "schedule": "v-zb", "zero": 1, "point": "step",
         "pipeline": {"p2p_timeout_s": TIMEOUT_S}},
        {**base, "name": "pp2xdp2-post-validation-v-zb-F", "schedule": "v-zb", "point": "F", "pipeline": pv},
        # The optimistic step 2 waits for nothing: the survivors learn of the death in step 3.
        {**base, "name": "pp2xdp2-post-validation-v-zb-step", "schedule": "v-zb", "point": "step", "pipeline": pv,
         "named_step": 3},
        # pass_costs "measure" (auto's machinery): a rank dies as the choice after the measuring steps starts.
        {**base, "name": "pp2xdp2-measure-v-zb-choose", "schedule": "v-zb", "point": "choose",
         "pipeline": {"p2p_timeout_s": TIMEOUT_S, "pass_costs": "measure"}, "named_when": "the schedule's choice after train step 2"},
    ]


def _strict_cases() -> list[dict[str, Any]]:
    """Cases under every NCCL rule (lazy init, first contact, synchronize, one queue per rank), where
    a collective queues behind a transfer to the dead rank and a check issued in one step is
    waited for in the next: each survivor still fails within the timeout."""
    rules = {"mode": "lazy", **ALL_RULES}
    picked = {"p4-zb-h2-W", "p4-v-zb-send", "pp2xdp2-zero1-v-zb-step", "pp2xdp2-post-validation-v-zb-step",
              "pp2xdp2-measure-v-zb-choose"}
    return [dict(c, name=f"{c['name']}-all-rules", nccl=rules) for c in _extra_cases() + _cases() if c["name"] in picked]


CASES = _extra_cases() + _cases() + _strict_cases()  # ZeRO's slow start first, under the others' waits


def _run(cases: list[dict[str, Any]], workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TMPDIR=str(workdir), DS_VSHAPE_FAULT_HARD_LIMIT_S="60",
               DS_VSHAPE_FAULT_AFTER_KILL_S=str(AFTER_KILL_S))
    # As every launch: NCCL's eager rules unless DS_VSHAPE_TEST_NCCL says otherwise, and the stricter
    # rules (first contact, synchronize, one queue) as the environment sets them.
    emulation_env(env, default_mode())
    cmd = [sys.executable, "-m", "tests.distributed.fault_driver", str(workdir / "cases.json"), str(workdir), str(CONCURRENT)]
    proc = run_ranks(cmd, env=env, timeout=600)
    (workdir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"fault driver exited {proc.returncode}; log tail:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads((workdir / "results.json").read_text())


def _table(results: dict[str, Any]) -> str:
    rows = ["| case | time to exit after the kill (s), per survivor | what the slowest survivor waited for |", "|---|---|---|"]
    for name, res in results.items():
        if not res["killed"]:
            rows.append(f"| {name} | no kill | |")
            continue
        took = {r: v["ended"] - res["killed"]["at"] for r, v in res["ranks"].items() if r != str(KILL_RANK)}
        slow = max(took, key=took.__getitem__)
        error = (res["ranks"][slow]["error"] or "").split(", train step ", 1)[-1].split(": ", 1)[-1]
        error = error.split(" did not complete")[0].split(" failed")[0]  # what the slowest survivor waited for
        rows.append(f"| {name} | {' '.join(f'{t:.1f}' for t in took.values())} | {error} |")
    return "\n".join(rows) + "\n"


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("faults")
    started = time.monotonic()
    results = _run(CASES, workdir)
    (workdir / "exit_times.md").write_text(_table(results) + f"\nall {len(CASES)} cases: {time.monotonic() - started:.0f} s\n")
    return results


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_survivors_of_a_killed_rank_exit_within_the_timeout_naming_what_they_waited_for(faults: dict, name: str) -> None:
    res = faults[name]
    killed = res["killed"]
    assert killed is not None, (f"{name}: rank {KILL_RANK} never reached its kill point: {res['ranks']}; stacks of "
                                f"ranks left running:\n" + "\n".join(res["stacks"].values()))
    assert res["left_running"] == [], (
        f"{name}: ranks {res['left_running']} were still running {AFTER_KILL_S:g} s after the kill "
        f"({killed['at'] - res['started']:.1f} s after the start); their stacks:\n" + "\n".join(res["stacks"].values()))
    assert res["ranks"][str(KILL_RANK)]["exit"] == -9, res["ranks"][str(KILL_RANK)]
    assert not process_alive(killed["holder"]), f"{name}: the killed rank's socket holder {killed['holder']} outlived the case"
    case = next(c for c in CASES if c["name"] == name)
    p, step = case["p"], case.get("named_step", case["kill_step"])
    # A death found in the step after the kill (post-validation's optimistic step): the survivors first finish
    # the step the kill interrupted, then wait out the timeout in the next, so one more margin of work.
    bound = TIMEOUT_S + MARGIN_S * (2 if step != case["kill_step"] else 1)
    for rank, got in res["ranks"].items():
        if rank == str(KILL_RANK):
            continue
        took = got["ended"] - killed["at"]
        assert got["exit"] == 1, f"{name} rank {rank}: exit status {got['exit']} ({got['error']})"
        assert took <= bound, f"{name} rank {rank}: exited {took:.1f} s after the kill, bound {bound:g} s ({got['error']})"
        error = got["error"] or ""
        assert error.split(": ", 1)[0].rsplit(".", 1)[-1] in NAMED, f"{name} rank {rank}: {error!r}"
        stage = int(rank) % p if p == 4 else int(rank) // 2  # PP2xDP2: global rank = stage * 2 + replica
        when = case.get("named_when", f"train step {step}")
        assert f"pipeline rank {stage} (global rank {rank}), {when}: " in error, f"{name} rank {rank}: {error!r}"
        waited = ("receive of ", "send of ", " over global ranks [")
        assert any(w in error for w in waited), f"{name} rank {rank}: what it waited for is not named: {error!r}"
