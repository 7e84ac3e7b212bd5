"""Plots for ``report_auto.py``: each auto case's measured timeline above the simulated one, and
the measuring steps' times."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ds_vshape.schedules.ir import Action, Kind, Schedule  # noqa: E402
from ds_vshape.schedules.render import draw_boxes, style_axes  # noqa: E402
from ds_vshape.schedules.simulate import SimResult  # noqa: E402

PROFILE_TEXT = {
    "a": "T_W = T_B/2 (F 20, B 20, W 10 ms per 1/p slice)",
    "b": "rank {slow} twice as slow (its layers' F, B, W x{factor})",
    "c": "memory limit {limit:g} M_B (half of 1F1B's p M_B)",
}


# ---- plots -------------------------------------------------------------------------------------

def profile_title(profile: str, setup: dict[str, Any], p: int) -> str:
    args = setup.get("args", {})
    limit = args.get("memory_limit") or p / 2
    return PROFILE_TEXT[profile].format(slow=args.get("slow_rank", 1), factor=args.get("slow_factor", 2), limit=limit)


def measured_result(record: dict[str, Any], p: int) -> tuple[SimResult, Schedule]:
    """A SimResult holding one measured step (ms from each rank's step start), for render's drawing code."""
    schedule = Schedule.from_dict(record["ranks"][0]["schedule_ir"])
    timeline = []
    for g in record["ranks"]:
        step = next(s for s in reversed(g["steps"]) if "events" in s)
        kind = {"F": Kind.F, "B": Kind.B, "W": Kind.W, "BW": Kind.BW}
        timeline.append(tuple(((t0 - step["t0"]) * 1e3, (t1 - step["t0"]) * 1e3, Action(kind[k], stage, mb))
                              for k, stage, mb, t0, t1 in step["events"]))
    makespan = max((t[-1][1] for t in timeline if t), default=0.0)
    busy = tuple(sum(e - s for s, e, _ in t) for t in timeline)
    return SimResult(makespan, busy, (0.0,) * p, tuple(timeline)), schedule


def simulated_result(record: dict[str, Any], schedule: Schedule) -> SimResult:
    timeline = tuple(tuple((s * 1e3, e * 1e3, Action(Kind(k), stage, mb)) for s, e, k, stage, mb in t)
                     for t in record["ranks"][0]["auto"]["sim_timeline"])
    makespan = max((t[-1][1] for t in timeline if t), default=0.0)
    busy = tuple(sum(e - s for s, e, _ in t) for t in timeline)
    return SimResult(makespan, busy, (0.0,) * schedule.stages, timeline)


def plot_timelines(records: list[dict[str, Any]], out_dir: Path, setup: dict[str, Any]) -> list[Path]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    autos = [r for r in records if r.get("kind") == "case" and r["schedule"] == "auto" and not any("error" in g for g in r["ranks"])]
    if not autos:
        return []
    m = min(r["m"] for r in autos)
    paths = []
    for profile in sorted({r["profile"] for r in autos}):
        picks = {}
        for r in autos:
            if r["m"] == m and r["profile"] == profile:
                picks.setdefault(r["placement"], r)  # the first round's
        panels = [(pl, rec) for pl, rec in sorted(picks.items(), key=lambda kv: kv[0] != "linear")]
        fig = Figure(figsize=(16, 2.6 * 2 * len(panels)), dpi=110)
        FigureCanvasAgg(fig)
        axes = fig.subplots(2 * len(panels), 1)
        handles_all: dict[str, Any] = {}
        p = panels[0][1]["p"]
        for k, (placement, rec) in enumerate(panels):
            measured, schedule = measured_result(rec, p)
            sim = simulated_result(rec, schedule)
            span = max(measured.makespan, sim.makespan)
            auto = rec["ranks"][0]["auto"]
            step = statistics.median(s["step_s"] for s in rec["ranks"][0]["steps"])
            for j, (result, what) in enumerate(((measured, f"measured: one step, F/B/W instructions (step {step * 1e3:.0f} ms "
                                                 "between barriers)"),
                                                (sim, f"simulated with the costs auto measured: makespan {sim.makespan:.0f} ms; "
                                                 f"predicted step {auto['predicted_s'] * 1e3:.0f} ms with the measured overhead"))):
                ax = axes[2 * k + j]
                draw_boxes(ax, result, schedule)
                for h in style_axes(ax, result, schedule):
                    handles_all[h.get_label()] = h
                ax.set_xlim(0, span)
                ax.set_xlabel("ms")
                ax.set_title(f"{placement} placement, auto -> {schedule.name} (p={p}, m={m}), {what}", fontsize=9)
        fig.suptitle(f"profile {profile}: {profile_title(profile, setup, p)}", fontsize=11)
        fig.legend(handles=list(handles_all.values()), loc="lower center", ncol=len(handles_all), frameon=False, fontsize=9)
        fig.tight_layout(rect=(0.0, 0.03, 1.0, 0.97))
        path = out_dir / f"auto_{profile}.png"
        fig.savefig(path)
        paths.append(path)
    return paths


def plot_steps(rows: list[dict[str, Any]], out_dir: Path, setup: dict[str, Any], p: int) -> Path | None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ms = sorted({r["m"] for r in rows})
    profiles = sorted({r["profile"] for r in rows})
    if not rows:
        return None
    fig = Figure(figsize=(7 * 2 * len(ms), 3.2 * len(profiles)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(profiles), 2 * len(ms), squeeze=False)
    for i, profile in enumerate(profiles):
        for j, (m, placement) in enumerate((m, pl) for m in ms for pl in ("linear", "v")):
            ax = axes[i][j]
            here = [r for r in rows if (r["m"], r["profile"], r["placement"]) == (m, profile, placement) and "step_s" in r]
            here.sort(key=lambda r: (r["schedule"] != "auto", r["schedule"]))
            names = [("auto->" + "/".join(dict.fromkeys(r["choices"]))) if r["schedule"] == "auto" else r["label"].replace(" = ", "=")
                     for r in here]
            xs = range(len(here))
            ax.bar(xs, [r["step_s"] * 1e3 for r in here], color=["#D55E00" if r["schedule"] == "auto" else "#0072B2" for r in here],
                   label="measured (best round's median)")
            pred = [statistics.median(r["predicted_s"]) if r["schedule"] == "auto" else r.get("predicted_s") for r in here]
            ax.scatter([x for x, v in zip(xs, pred) if v is not None], [v * 1e3 for v in pred if v is not None], marker="_", s=400,
                       color="black", zorder=3, label="auto's prediction")
            values = [r["step_s"] * 1e3 for r in here] + [v * 1e3 for v in pred if v is not None]
            if values:  # the differences are a few percent: do not start the axis at 0
                ax.set_ylim(0.85 * min(values), 1.04 * max(values))
            ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
            ax.set_ylabel("step (ms)")
            ax.set_title(f"{profile}: {placement}, m={m}", fontsize=9)
            if i == 0 and j == 0:
                ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("step time per schedule: measured vs auto's prediction; " +
                 "; ".join(f"{k}: {profile_title(k, setup, p)}" for k in profiles), fontsize=9)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 0.96))
    path = out_dir / "auto_steps.png"
    fig.savefig(path)
    return path
