"""Tables and timelines for bench_steady.py: steady period per case, against ideal and simulator.

Reads the JSON lines bench_steady.py appended, writes ``steady.md``, ``steady.json`` and one
PNG per case (``steady_<m>_<label>.png``): the last two measured steps on the asynchronous
device (each rank's passes as its device stream ran them) above the simulator's two steps.

Simulated steady period: the schedule's two steps back to back with no synchronisation
between them (each rank runs step 2's passes after its step-1 passes; only the data
dependencies order the ranks), minus one step: what the schedule gives when nothing holds the
ranks at a step's end. A case that does hold them (DeepSpeed's loss broadcast; a global
clipping norm that is awaited) is simulated as one isolated step.

Usage: ``python benchmarks/report_steady.py benchmarks/results/raw/steady.jsonl benchmarks/results``
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cell, machine_info, recorded_commit  # noqa: E402
from benchmarks.report_rows import RAW, as_lowered, read_jsonl, schedule_of  # noqa: E402
from ds_vshape.schedules import Costs, Schedule, simulate  # noqa: E402

__all__ = ["steady_rows", "main"]

COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", "BW": "#b279a2"}


def two_steps(sched: Schedule) -> Schedule:
    """The schedule run twice in a row on every rank (step 2's micro-batches numbered after step 1's)."""
    m = sched.micro_batches
    ranks = tuple(acts + tuple(replace(a, micro_batch=a.micro_batch + m) for a in acts) for acts in sched.ranks)
    return replace(sched, micro_batches=2 * m, ranks=ranks)


def _holds_ranks(case: dict[str, Any]) -> bool:
    """Whether every step ends with all ranks waiting for the slowest one."""
    keys = case.get("pipeline") or {}
    if case["system"] == "deepspeed" or (case["system"] == "ds_vshape" and not keys.get("post_validation")):
        return True  # the loss broadcast
    if case["clip"] > 0:
        return not (case["system"] == "ds_vshape" and keys.get("speculate_after") is not None)
    return False


def simulated(case: dict[str, Any], hop: float) -> tuple[float, float, Any, Schedule] | None:
    sched = schedule_of(case["system"], case["schedule"], case["p"], case["m"])
    if sched is None:
        return None
    if case["system"] == "ds_vshape":
        sched = as_lowered(sched)
    t = case["t_pass_s"]
    costs = Costs(f=t, b=t, w=t, comm=hop)
    one = simulate(sched, costs)
    two = simulate(two_steps(sched), costs)
    period = one.makespan if _holds_ranks(case) else two.makespan - one.makespan
    return period, one.makespan, two, sched


def steady_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    setup = next(r for r in records if r["kind"] == "setup")
    rows = []
    for case in (r for r in records if r["kind"] == "case"):
        row: dict[str, Any] = {k: case[k] for k in ("label", "system", "schedule", "clip", "p", "m", "t_pass_s")}
        row["pipeline"] = case.get("pipeline") or {}
        errs = [g["error"] for g in case["ranks"] if "error" in g]
        if errs:
            rows.append({**row, "error": errs[0]})
            continue
        steps = len(case["ranks"][0]["ends"])
        ends = [max(g["ends"][k] for g in case["ranks"]) for k in range(steps)]
        row["period_s"] = (ends[-1] - ends[0]) / (steps - 1)
        row["ideal_s"] = case["m"] * 3 * case["t_pass_s"]
        row["efficiency"] = row["ideal_s"] / row["period_s"]
        row["rerun"] = max(g.get("rerun", 0) for g in case["ranks"])
        sim = simulated(case, setup["hop_s"])
        row["sim_period_s"] = sim[0] if sim else None
        rows.append(row)
    for row in rows:
        for ref, key in (("DeepSpeed 1F1B", "vs_ds_1f1b"), ("torch ZBV", "vs_torch_zbv")):
            clip = " clip" if row.get("clip") else ""
            other = next((r for r in rows if r["label"] == ref + clip and r["m"] == row["m"] and "period_s" in r), None)
            if other is not None and "period_s" in row:
                row[key] = other["period_s"] / row["period_s"]
    return rows


def markdown(rows: list[dict[str, Any]], machine: dict[str, Any], setup: dict[str, Any]) -> str:
    lines = [
        "# Multi-step steady state on the asynchronous emulated device",
        "",
        "`make bench-steady` (`benchmarks/bench_steady.py`, then `benchmarks/report_steady.py`). p = "
        f"{setup['p']} ranks (gloo, this machine), each pass of a 1/p slice {setup['t_pass_s'] * 1e3:g} ms on an emulated device "
        f"stream (`benchmarks/async_device.py`; hop {setup['hop_s'] * 1e6:.2f} us). {setup['warmup']} warm-up steps, then "
        f"{setup['steps']} steps back to back; period = (end of the last step - end of the first) / {setup['steps'] - 1}, "
        "latest rank. Ideal = m x (T_F + T_B + T_W).",
        "",
        "`clip`: gradient clipping on, with a threshold no step reaches, so the figure is the cost of the check: "
        "DeepSpeed and ds_vshape without post-validation reduce the global norm before the optimizer step; torch gets "
        "the same global clip (torch.distributed.pipelining has none of its own). `+pv`: post-validation speculating from "
        "the first step (`speculate_after` 0); `+pv wait`: post-validation that waits for each check before the next "
        "step's first pass (`speculate_after` null). `sim`: the simulator's steady period on the order the system runs "
        "(see report_steady.py).",
        "",
        f"Machine: {machine.get('cpu', '?')} ({machine.get('cores', '?')} cores); commit {recorded_commit(RAW)}.",
    ]
    for m in sorted({r["m"] for r in rows}, reverse=True):
        lines += ["", f"## m = {m}", "", "| case | period (s) | ideal (s) | eff. | sim (s) | gap to sim | vs DS 1F1B | vs torch ZBV |",
                  "|---|--:|--:|--:|--:|--:|--:|--:|"]
        for r in (r for r in rows if r["m"] == m):
            if "error" in r:
                lines.append(f"| {r['label']} | error: {r['error'][:80]} | | | | | | |")
                continue
            gap = (r["period_s"] / r["sim_period_s"] - 1) * 100 if r.get("sim_period_s") else None
            lines.append(f"| {r['label']} | {r['period_s']:.4f} | {r['ideal_s']:.3f} | {r['efficiency']:.3f} | "
                         f"{cell(r.get('sim_period_s'), '.4f')} | {cell(gap, '+.1f')}% | {cell(r.get('vs_ds_1f1b'), '.3f')} | "
                         f"{cell(r.get('vs_torch_zbv'), '.3f')} |")
    return "\n".join(lines) + "\n"


def plot_case(case: dict[str, Any], sim: Any, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = len(case["ranks"][0]["ends"])
    ends = [max(g["ends"][k] for g in case["ranks"]) for k in range(steps)]
    lo, hi = ends[-3], ends[-1]
    p = len(case["ranks"])
    fig, axes = plt.subplots(2, 1, figsize=(12, 1.0 + 0.9 * p), sharex=False)
    ax = axes[0]
    for rank, g in enumerate(case["ranks"]):
        for kind, start, end in g["history"]:
            if end > lo and start < hi:
                ax.barh(rank, end - start, left=start - lo, color=COLORS.get(kind, "grey"), edgecolor="white", linewidth=0.2)
    ax.set_title(f"{case['label']}, m={case['m']}: measured, last two steps (async emulated device)", fontsize=9)
    ax.set_xlim(0, hi - lo)
    ax = axes[1]
    if sim is not None:
        for rank, events in enumerate(sim.timeline):
            for start, end, action in events:
                ax.barh(rank, end - start, left=start, color=COLORS.get(action.kind.value, "grey"), edgecolor="white",
                        linewidth=0.2)
        ax.set_xlim(0, hi - lo)
        ax.set_title("simulated: the same schedule, two steps back to back, no sync between them", fontsize=9)
    for a in axes:
        a.set_yticks(range(p))
        a.set_yticklabels([f"rank {r}" for r in range(p)], fontsize=7)
        a.invert_yaxis()
        a.set_xlabel("s", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    src, dest = Path(argv[0]), Path(argv[1])
    records = read_jsonl(src)
    setup = next(r for r in records if r["kind"] == "setup")
    rows = steady_rows(records)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "steady.md").write_text(markdown(rows, machine_info(RAW), setup))
    (dest / "steady.json").write_text(json.dumps(rows, indent=1))
    for case in (r for r in records if r["kind"] == "case"):
        if any("error" in g for g in case["ranks"]):
            continue
        sim = simulated(case, setup["hop_s"])
        slug = re.sub(r"[^a-z0-9]+", "_", case["label"].lower()).strip("_")
        plot_case(case, sim[2] if sim else None, dest / f"steady_m{case['m']}_{slug}.png")
    print((dest / "steady.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
