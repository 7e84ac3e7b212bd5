"""Rows of the schedule benchmarks: raw JSON lines read, best rounds picked, pass times and waits
measured, the simulator calibrated with them, targets checked. report.py prints them."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ds_vshape.config import PipelineConfig  # noqa: E402
from ds_vshape.schedules import Costs, Schedule, generate, simulate  # noqa: E402

RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "benchmarks" / "results"))
RAW = RESULTS / "raw"
W_MEMORY = 0.5  # ds_vshape's default; the emulated layer parks exactly this share (see emulated.py)
TORCH_CLASS = {
    "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B", "loopedbfs": "ScheduleLoopedBFS",
    "interleavedzerobubble": "ScheduleInterleavedZeroBubble", "zbvzerobubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# ds_vshape schedule -> torch schedules it is measured against (same placement family).
COUNTERPARTS = {
    "1f1b": ["1f1b"], "interleaved": ["interleaved1f1b"], "breadth-first": ["loopedbfs"],
    "v-zb": ["zbvzerobubble", "interleavedzerobubble", "dualpipev"],
}
KIND_OF = {"ForwardPass": "F", "BackwardInput": "B", "BackwardWeight": "W", "FusedBackward": "BW", "BackwardPass": "BW"}
COMPUTE = set(KIND_OF)
WAITS = {"RecvActivation", "RecvGrad", "CommitP2P"}
SYSTEM_ORDER = {"deepspeed": 0, "ds_vshape": 1, "torch": 2}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- schedules for the simulator -------------------------------------------------------------
def schedule_of(system: str, schedule: str, p: int, m: int, *, pipeline: dict[str, Any] | None = None) -> Schedule | None:
    """The schedule a row's engine ran; ``pipeline``: the row's own pipeline keys (a bench variant's)."""
    if system == "ds_vshape":
        return PipelineConfig(schedule=schedule, **(pipeline or {})).make_schedule(p, m)  # exactly what the engine built
    if system == "deepspeed":
        return generate("1f1b", p, m) if schedule == "1f1b" else None  # DualPipeV: no IR form
    from benchmarks.torch_orders import torch_schedule

    return torch_schedule(TORCH_CLASS[schedule], p, m)


def chunks_of(system: str, schedule: str, sched: Schedule | None) -> int:
    if sched is not None:
        return sched.chunks_per_rank
    return 2 if schedule == "dualpipev" else 1


# ---- per-row figures -------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def pass_medians_ms(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Median instruction time per pass kind (ms), over every rank and timed step."""
    per_kind: dict[str, list[float]] = {}
    for r in ranks:
        for step in r["steps"]:
            for name, ms in step.get("handler_median_ms", {}).items():
                if name in KIND_OF:
                    per_kind.setdefault(KIND_OF[name], []).append(ms)
    return {k: statistics.median(v) for k, v in per_kind.items()}


def overhead_profile(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per rank (medians over steps): where the step went, for engines we can instrument."""
    if not ranks[0]["steps"][0].get("handler_s"):
        return None
    out = []
    for r in ranks:
        rows = []
        for s in r["steps"]:
            h, n, p10 = s["handler_s"], s["handler_n"], s.get("handler_p10_ms", {})
            device = sum(s["device"]["slept_s"].values())
            fast = [p10[k] for k in WAITS if k in p10]
            compute = sum(v for k, v in h.items() if k in COMPUTE)
            n_compute = sum(v for k, v in n.items() if k in COMPUTE)
            waits = sum(v for k, v in h.items() if k in WAITS)
            other = sum(v for k, v in h.items() if k not in COMPUTE | WAITS)
            rows.append({
                "device_s": device, "compute_overhead_s": compute - device, "compute_passes": n_compute,
                "overhead_ms_per_pass": 1e3 * (compute - device) / max(n_compute, 1),
                "recv_wait_s": waits, "other_instructions_s": other, "outside_instructions_s": s["local_s"] - sum(h.values()),
                "comm_instructions": sum(v for k, v in n.items() if k in WAITS or k.startswith("Send")),
                # A receive at its fast end (p10) is one whose data was already there: its pure cost.
                "recv_fast_ms": statistics.mean(fast) if fast else 0.0,
            })
        out.append({k: statistics.median(x[k] for x in rows) for k in rows[0]})
    return {"per_rank": out}


def best_rounds(cases: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[float], list[float]]]:
    """One record per (system, schedule, p, m): the round with the lowest median step time.

    Returns (record, median of each round, every timed step of every round). A burst of
    other load on the shared machine slows whatever runs then; the rounds run in opposite
    orders, so the best round is the one the burst missed.
    """
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for c in cases:
        groups.setdefault((c["system"], c["schedule"], c["p"], c["m"], c["t_pass_s"]), []).append(c)
    out = []
    for recs in groups.values():
        ok = [c for c in recs if not any("error" in r for r in c["ranks"])]
        if not ok:
            out.append((recs[0], [], []))
            continue
        medians = [statistics.median(s["step_s"] for s in c["ranks"][0]["steps"]) for c in ok]
        best = ok[medians.index(min(medians))]
        out.append((best, medians, [s["step_s"] for c in ok for s in c["ranks"][0]["steps"]]))
    return out


def as_lowered(sched: Schedule) -> Schedule:
    """The schedule with each rank's actions in the order the engine really runs them.

    The orders come from the engine's own lowering (``lowering.lowered_orders``, what ``lower``
    turns into instructions): it fuses a B directly followed by its own W into one BW pass,
    but not when B's input gradient goes to another rank, so those B's stay split and their
    gradient is sent before W. Re-deriving the fusion here (as this column once did, fusing
    every B) goes stale whenever the lowering changes.
    """
    from dataclasses import replace

    from ds_vshape.schedules.lowering import lowered_orders

    return replace(sched, ranks=lowered_orders(sched))


def calibrated_makespan(sched: Schedule, passes: dict[str, float], ranks: list[dict[str, Any]], lat: dict[str, float]) -> float:
    """The simulator with this row's measured costs instead of the set ones.

    * each compute pass takes its measured median instruction time, plus its share of the
      rank's send and receive instructions at their fast end (p10: a receive whose data is
      already there still costs its Python and rendezvous time, which the plain simulator
      does not charge to the rank);
    * one hop costs the measured gloo one-way latency;
    * the step tail (reduce, optimizer step, loss broadcast, closing barrier) is added.
    """
    extra, tail = [], []
    for r in ranks:
        per_step_extra, per_step_tail = [], []
        for st in r["steps"]:
            h, n, p10 = st["handler_s"], st["handler_n"], st.get("handler_p10_ms", {})
            comm = sum(h.get(k, 0.0) for k in ("SendActivation", "SendGrad"))
            comm += sum(n.get(k, 0) * p10.get(k, 0.0) / 1e3 for k in WAITS)
            passes_n = sum(v for k, v in n.items() if k in COMPUTE)
            per_step_extra.append(comm / max(passes_n, 1))
            per_step_tail.append(sum(h.get(k, 0.0) for k in ("ReduceGrads", "ReduceTiedGrads", "OptimizerStep")))
        extra.append(statistics.median(per_step_extra))
        tail.append(statistics.median(per_step_tail))
    alpha = statistics.median(extra)
    v = sched.chunks_per_rank
    f = (passes["F"] / 1e3 + alpha) * v
    if "B" in passes and "W" in passes:
        b, w = (passes["B"] / 1e3 + alpha) * v, (passes["W"] / 1e3 + alpha) * v
    else:
        b = w = (passes["BW"] / 1e3 + alpha) * v / 2
    sim = simulate(sched, Costs(f=f, b=b, w=w, comm=lat.get("gloo_send_recv_s", 0.0), w_memory=W_MEMORY))
    return sim.makespan + max(tail) + lat.get("barrier_s", 0.0)


def build_rows(cases: list[dict[str, Any]], latency: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    rows = []
    for c, round_medians, all_steps in best_rounds(cases):
        system, name, p, m, t = c["system"], c["schedule"], c["p"], c["m"], c["t_pass_s"]
        row: dict[str, Any] = {"system": system, "schedule": name, "p": p, "m": m, "t_pass_s": t,
                               "ideal_s": m * 3 * t, "layers": p * c["layers_per_rank"]}
        if system == "torch":
            row["torch_class"] = TORCH_CLASS[name]
        if system == "deepspeed":
            row["deepspeed_class"] = "TrainSchedule" if name == "1f1b" else "DualPipeVSchedule"
        errors = [r["error"] for r in c["ranks"] if "error" in r]
        try:
            sched = schedule_of(system, name, p, m)
        except Exception as err:  # a schedule we cannot express: no simulator column
            sched, row["sim_note"] = None, f"{type(err).__name__}: {err}"
        row["v"] = chunks_of(system, name, sched)
        if errors:
            row["error"] = errors[0].splitlines()[0][:400]
            rows.append(row)
            continue
        ranks = c["ranks"]
        steps = [s["step_s"] for s in ranks[0]["steps"]]
        row["step_time_s"] = statistics.median(steps)  # median of the timed steps of the best round
        row["step_times_s"] = steps
        row["round_medians_s"] = round_medians
        row["step_time_all_rounds_median_s"] = statistics.median(all_steps)
        row["efficiency"] = row["ideal_s"] / row["step_time_s"] if t > 0 else None
        row["peak_activation_bytes"] = [max(s["peak_activation_bytes"] for s in r["steps"]) for r in ranks]
        row["peak_activation_max_bytes"] = max(row["peak_activation_bytes"])
        row["device_s_per_rank"] = [statistics.median(sum(s["device"]["slept_s"].values()) for s in r["steps"]) for r in ranks]
        row["device_asked_s_per_rank"] = [statistics.median(sum(s["device"]["asked_s"].values()) for s in r["steps"]) for r in ranks]
        passes = pass_medians_ms(ranks)
        if passes:
            row["pass_ms"] = passes
        prof = overhead_profile(ranks)
        if prof:
            row["overhead"] = prof
        lat = latency.get(p, {})
        row["comm_hop_s"] = lat.get("gloo_send_recv_s")
        if sched is not None and t > 0:
            nominal = Costs(f=t, b=t, w=t, comm=lat.get("gloo_send_recv_s", 0.0), w_memory=W_MEMORY)
            sim = simulate(sched, nominal)
            row["sim_s"] = sim.makespan
            row["sim_gap"] = row["step_time_s"] / sim.makespan - 1
            row["sim_no_comm_s"] = simulate(sched, Costs(f=t, b=t, w=t, w_memory=W_MEMORY)).makespan
            row["sim_peak_mem_mb"] = list(sim.peak_memory)
            if system == "ds_vshape":
                row["sim_lowered_s"] = simulate(as_lowered(sched), nominal).makespan
                row["sim_lowered_gap"] = row["step_time_s"] / row["sim_lowered_s"] - 1
            if passes and "F" in passes:
                cal = calibrated_makespan(as_lowered(sched) if system == "ds_vshape" else sched, passes, ranks, lat)
                row["sim_calibrated_s"] = cal
                row["sim_calibrated_gap"] = row["step_time_s"] / cal - 1
        rows.append(row)
    _relative_to_deepspeed(rows)
    rows.sort(key=lambda r: (r["p"], -r["m"], SYSTEM_ORDER[r["system"]]))
    return rows


def _relative_to_deepspeed(rows: list[dict[str, Any]]) -> None:
    base = {(r["p"], r["m"], r["t_pass_s"]): r for r in rows if r["system"] == "deepspeed" and r["schedule"] == "1f1b" and "step_time_s" in r}
    for r in rows:
        b = base.get((r["p"], r["m"], r["t_pass_s"]))
        if b is None or "step_time_s" not in r:
            continue
        r["speedup_vs_deepspeed_1f1b"] = b["step_time_s"] / r["step_time_s"]
        r["mem_vs_deepspeed_1f1b"] = r["peak_activation_max_bytes"] / b["peak_activation_max_bytes"]
        if "sim_peak_mem_mb" in r and "sim_peak_mem_mb" in b:
            r["sim_mem_vs_1f1b"] = max(r["sim_peak_mem_mb"]) / max(b["sim_peak_mem_mb"])


# ---- targets ---------------------------------------------------------------------------------
def _find(rows: list[dict[str, Any]], system: str, schedule: str, p: int, m: int) -> dict[str, Any] | None:
    for r in rows:
        if (r["system"], r["schedule"], r["p"], r["m"]) == (system, schedule, p, m) and "step_time_s" in r:
            return r
    return None


def targets(rows: list[dict[str, Any]], p: int = 4) -> list[dict[str, Any]]:
    """Each target of issue 5, with the measured figure and the schedule-only bound."""
    out: list[dict[str, Any]] = []

    def add(name: str, m: int, measured: float | None, goal: str, ok: bool | None, bound: str = "", note: str = "") -> None:
        out.append({"target": name, "p": p, "m": m, "measured": measured, "goal": goal,
                    "status": "n/a" if ok is None else ("pass" if ok else "MISS"), "bound": bound, "note": note})

    ms = sorted({r["m"] for r in rows if r["p"] == p}, reverse=True)
    ds = {m: _find(rows, "deepspeed", "1f1b", p, m) for m in ms}
    for sched in ("v-zb", "zb-h2"):
        for m in ms:
            r = _find(rows, "ds_vshape", sched, p, m)
            eff = r["efficiency"] if r else None
            bound = f"schedule bound {r['ideal_s'] / r['sim_no_comm_s']:.3f}" if r else ""
            add(f"{sched} efficiency (ideal / step)", m, eff, ">= 0.93", None if eff is None else eff >= 0.93, bound)
    for m in ms:
        r = _find(rows, "ds_vshape", "v-zb", p, m)
        goal = 1.15 if m >= 16 else 1.30
        sp = r.get("speedup_vs_deepspeed_1f1b") if r else None
        bound = ""
        if r and ds[m]:
            bound = f"schedule bound {ds[m]['sim_no_comm_s'] / r['sim_no_comm_s']:.3f}"
        add("v-zb speed-up over DeepSpeed 1F1B", m, sp, f">= {goal:.2f}x", None if sp is None else sp >= goal, bound,
            f"steady-state theory (m+p-1)/m = {(m + p - 1) / m:.3f}")
    for m in ms:
        r = _find(rows, "ds_vshape", "1f1b", p, m)
        ratio = r["step_time_s"] / ds[m]["step_time_s"] if r and ds[m] else None
        add("ds_vshape 1f1b step / DeepSpeed 1F1B step", m, ratio, "<= 1.03", None if ratio is None else ratio <= 1.03)
    for ours, theirs_list in COUNTERPARTS.items():
        for theirs in theirs_list:
            for m in ms:
                a, b = _find(rows, "ds_vshape", ours, p, m), _find(rows, "torch", theirs, p, m)
                ratio = a["step_time_s"] / b["step_time_s"] if a and b else None
                bound = f"sim {a['sim_no_comm_s'] / b['sim_no_comm_s']:.3f}" if a and b and "sim_no_comm_s" in b else ""
                add(f"ds_vshape {ours} step / torch {theirs} step", m, ratio, "<= 1.00", None if ratio is None else ratio <= 1.0, bound)
    for sched, goal in (("v-half", 0.55), ("v-min", 0.40)):
        for m in ms:
            r = _find(rows, "ds_vshape", sched, p, m)
            mem = r.get("mem_vs_deepspeed_1f1b") if r else None
            bound = f"simulator {r['sim_mem_vs_1f1b']:.3f}" if r and "sim_mem_vs_1f1b" in r else ""
            add(f"{sched} peak activation / 1F1B (busiest rank)", m, mem, f"<= {goal:.2f}", None if mem is None else mem <= goal, bound)
    for m in ms:
        ours = [r for r in rows if r["p"] == p and r["m"] == m and r["system"] == "ds_vshape" and "sim_gap" in r]
        if not ours:
            continue
        worst = max(ours, key=lambda r: abs(r["sim_gap"]))
        within = sum(abs(r["sim_gap"]) <= 0.05 for r in ours)
        cal = [abs(r["sim_calibrated_gap"]) for r in ours if "sim_calibrated_gap" in r]
        add("simulator vs measured, worst ds_vshape row |gap|", m, abs(worst["sim_gap"]), "<= 0.05", abs(worst["sim_gap"]) <= 0.05,
            f"{within}/{len(ours)} rows within 5%", f"worst: {worst['schedule']}; calibrated pass times: worst |gap| {max(cal):.3f}" if cal else "")
    return out
