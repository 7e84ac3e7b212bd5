"""``make bench-real``'s report: real compute at p=2, measured against the simulator, with where the time went.

Reads ``results/raw/real_p2.jsonl`` (``bench_real.py``) and writes ``results/real.md`` and
``results/real.json``. Per schedule it keeps the round with the lowest median step and shows:

* the measured step and tokens/s against DeepSpeed's own 1F1B;
* the simulator fed with this row's measured pass times (``calibrated_makespan``: each
  pass its median instruction time plus its share of transfer instructions, one hop at the
  measured latency, the step tail added), and the simulator fed with DeepSpeed 1F1B's pass
  times instead (B and W in this row's proportion): the schedule's gain if its passes cost
  what 1F1B's do, so the gap between the two is what the passes themselves cost more;
* per rank: time in passes, in other instructions, waiting in receives, outside any
  instruction, and off the CPU (wall minus the process's CPU time);
* the busiest rank's activation peak against DeepSpeed 1F1B's, and the simulator's ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import cell, machine_info  # noqa: E402
from benchmarks.report_rows import COMPUTE, RAW, RESULTS, W_MEMORY, WAITS, calibrated_makespan, pass_medians_ms, read_jsonl, schedule_of  # noqa: E402
from ds_vshape.schedules import Costs, Schedule, simulate  # noqa: E402

__all__ = ["real_rows", "real_markdown", "main"]

MICRO_BATCHES = 8  # ds_configs/<schedule>.json's gradient_accumulation_steps


def _best(records: list[dict[str, Any]]) -> tuple[dict[str, Any], list[float]]:
    """The round with the lowest median step (a burst of other load slows one round, not all)."""
    ok = [c for c in records if not any("error" in r for r in c["ranks"])]
    if not ok:
        return records[0], []
    medians = [statistics.median(s["step_s"] for s in c["ranks"][0]["steps"]) for c in ok]
    return ok[medians.index(min(medians))], medians


def _breakdown(rank: dict[str, Any]) -> dict[str, float]:
    """Where one rank's step went (medians over the timed steps), in seconds."""
    rows = []
    for s in rank["steps"]:
        h = s["handler_s"]
        passes = {k: v for k, v in h.items() if k in COMPUTE}
        rows.append({
            "passes_s": sum(passes.values()),
            "waits_s": sum(v for k, v in h.items() if k in WAITS),
            "other_s": sum(v for k, v in h.items() if k not in COMPUTE | WAITS),
            "outside_s": s["local_s"] - sum(h.values()),
            "off_cpu_s": max(s["local_s"] - s["cpu_s"], 0.0),
            "step_s": s["step_s"],
            **{f"{k}_s": v for k, v in passes.items()},
        })
    keys = {k for r in rows for k in r}
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in sorted(keys)}


def _simulated(row: dict[str, Any], rec: dict[str, Any], lat: dict[str, float], base_passes: dict[str, float] | None,
               variants: dict[str, dict[str, Any]]) -> None:
    name, _, variant = row["schedule"].partition("+")
    keys = {k: v for k, v in variants.get(variant, {}).items() if k != "weight_grads_in_b"}  # those that shape the order
    if "ran" in rec:  # recorded by the run: the order its steps ran
        sched: Schedule | None = Schedule.from_dict(rec["ran"])
        picked = rec.get("ran_picked")
        row["ran"] = f"{sched.name} ({picked})" if picked else sched.name
    else:
        sched = schedule_of(row["system"], name, rec["p"], MICRO_BATCHES, pipeline=keys)  # a variant's own schedule
    if sched is None:
        return
    passes = pass_medians_ms(rec["ranks"])
    row["pass_ms"] = passes
    row["sim_step_s"] = calibrated_makespan(sched, passes, rec["ranks"], lat)
    if base_passes:
        # DeepSpeed's passes run a whole stage; this schedule's run one of its v chunks.
        f, bw = base_passes["F"] / sched.chunks_per_rank, base_passes["BW"] / sched.chunks_per_rank
        split = passes.get("B", 0.0) / (passes.get("B", 0.0) + passes["W"]) if "W" in passes else None
        at_base = {"F": f, "BW": bw} if split is None else {"F": f, "B": bw * split, "W": bw * (1 - split)}
        row["sim_at_1f1b_passes_s"] = calibrated_makespan(sched, at_base, rec["ranks"], lat)
    row["sim_memory"] = simulate(sched, Costs(w_memory=keys.get("w_memory", W_MEMORY))).max_peak_memory


def real_rows(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    lat = next((x for x in lines if x["kind"] == "latency"), {})
    variants = next((x["variants"] for x in lines if x["kind"] == "variants"), {})
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for x in lines:
        if x["kind"] == "real":
            groups.setdefault((x["system"], x["schedule"]), []).append(x)
    picked = {key: _best(recs) for key, recs in groups.items()}
    base_rec = picked.get(("deepspeed", "1f1b"), (None, []))[0]
    base_passes = pass_medians_ms(base_rec["ranks"]) if base_rec and not any("error" in r for r in base_rec["ranks"]) else None
    rows = []
    for (system, schedule), (rec, medians) in picked.items():
        row: dict[str, Any] = {"system": system, "schedule": schedule, "p": rec["p"], "model": rec.get("model")}
        errors = [r["error"] for r in rec["ranks"] if "error" in r]
        if errors:
            row["error"] = errors[0].splitlines()[0][:300]
            rows.append(row)
            continue
        r0 = rec["ranks"][0]
        row.update({"step_time_s": min(medians), "round_medians_s": medians, "tokens_per_step": r0["tokens_per_step"],
                    "loss_last": r0["steps"][-1]["loss"],
                    "peak_activation_bytes": [max(s["peak_activation_bytes"] for s in r["steps"]) for r in rec["ranks"]],
                    "ranks": [_breakdown(r) for r in rec["ranks"]]})
        row["tokens_per_s"] = row["tokens_per_step"] / row["step_time_s"]
        _simulated(row, rec, lat, base_passes, variants)
        rows.append(row)
    _relative(rows)
    return rows


def _relative(rows: list[dict[str, Any]]) -> None:
    base = next((r for r in rows if r["system"] == "deepspeed" and "step_time_s" in r), None)
    if base is None:
        return
    for r in rows:
        if "step_time_s" not in r:
            continue
        r["speedup_vs_deepspeed_1f1b"] = base["step_time_s"] / r["step_time_s"]
        r["mem_vs_deepspeed_1f1b"] = max(r["peak_activation_bytes"]) / max(base["peak_activation_bytes"])
        if "sim_memory" in r and "sim_memory" in base:
            r["sim_mem_vs_1f1b"] = r["sim_memory"] / base["sim_memory"]
        r["passes_vs_deepspeed_1f1b"] = max(x["passes_s"] for x in r["ranks"]) / max(x["passes_s"] for x in base["ranks"])


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each with its measured value and whether it holds."""
    out = []
    by = {r["schedule"] if r["system"] == "ds_vshape" else "deepspeed-1f1b": r for r in rows if "step_time_s" in r}
    for name, r in by.items():
        if "sim_step_s" in r:
            ratio = r["step_time_s"] / r["sim_step_s"]
            out.append(f"- {name}: measured / simulated step {ratio:.3f} ({'holds' if abs(ratio - 1) <= 0.05 else 'missed'}: within 5%)")
    for name in ("zb-h2", "v-zb"):
        if name in by:
            s = by[name].get("speedup_vs_deepspeed_1f1b", 0.0)
            out.append(f"- {name}: {s:.3f}x DeepSpeed 1F1B's tokens/s ({'holds' if s >= 1.07 else 'missed'}: >= 1.07x)")
    for name in ("v-half", "v-min", "v-zb"):
        if name in by and "sim_mem_vs_1f1b" in by[name]:
            r = by[name]
            out.append(f"- {name}: busiest rank's activations {r['mem_vs_deepspeed_1f1b']:.2f} of DeepSpeed 1F1B's, "
                       f"formula {r['sim_mem_vs_1f1b']:.2f}")
    return out


def real_markdown(rows: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    model = next((r["model"] for r in rows if r.get("model")), {}) or {}
    out = ["# Real compute at p = 2: every schedule against DeepSpeed 1F1B, measured and simulated", "",
           f"`make bench-real`: a Llama of hidden {model.get('hidden')}, {model.get('blocks')} blocks, {model.get('heads')} heads, "
           f"FFN {model.get('ffn')}, byte vocabulary, sequences of {model.get('seq_len')}; `ds_configs/<schedule>.json` (AdamW, "
           f"{MICRO_BATCHES} micro-batches of 4, clipping 1.0); 2 ranks under torchrun, one per CPU core, gloo. The schedules take "
           "turns step by step (a slow spell of the machine falls on all alike); each row is the median of its timed steps "
           "(the best round where several ran). CPU-bound and sensitive to other load on the machine.", "",
           f"Machine: {machine.get('cpu')} ({machine.get('cores')} cores), torch {machine.get('torch')}, deepspeed "
           f"{machine.get('deepspeed')}, commit {machine.get('commit')}; load average before/after: {machine.get('load', {}).get('real')}.", "",
           "Simulated: the schedule's simulator fed with this row's measured pass times (plus its transfer instructions, one "
           "hop at the measured latency, and the step tail). *At 1F1B's passes*: the same with DeepSpeed 1F1B's measured F "
           "and fused backward (split into B and W in this row's proportion), the step this schedule would take if its "
           "passes cost what 1F1B's do. *Passes*: the busiest rank's time inside F/B/W passes against DeepSpeed 1F1B's.", "",
           "| system | schedule | step (s) | tokens/s | vs DS 1F1B | simulated (s) | measured / sim | at 1F1B's passes (s) "
           "| gain there | passes vs DS 1F1B | peak act. per rank (MiB) | mem vs DS 1F1B | formula |",
           "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|"]
    base = next((r for r in rows if r["system"] == "deepspeed" and "step_time_s" in r), None)
    for r in rows:
        if "error" in r:
            out.append(f"| {r['system']} | {r['schedule']} | error: {r['error'][:120]} |" + " |" * 10)
            continue
        at = r.get("sim_at_1f1b_passes_s")
        gain = base["step_time_s"] / at if base and at else None
        peaks = ", ".join(f"{b / 2**20:.1f}" for b in r["peak_activation_bytes"])
        out.append(f"| {r['system']} | {r['schedule']} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} "
                   f"| {cell(r.get('speedup_vs_deepspeed_1f1b'), '.3f')}x | {cell(r.get('sim_step_s'), '.3f')} "
                   f"| {cell(r['step_time_s'] / r['sim_step_s'] if r.get('sim_step_s') else None, '.3f')} | {cell(at, '.3f')} "
                   f"| {cell(gain, '.3f')}x | {cell(r.get('passes_vs_deepspeed_1f1b'), '.3f')} | {peaks} "
                   f"| {cell(r.get('mem_vs_deepspeed_1f1b'), '.2f')} | {cell(r.get('sim_mem_vs_1f1b'), '.2f')} |")
    out += ["", "## Where each rank's step went (seconds, medians of the timed steps)", "",
            "Passes: time inside forward (F), backward-input (B), weight (W) and fused backward (BW) instructions. Other: "
            "the remaining instructions (sends, post-receive work, reduce, optimizer step). Waits: receive instructions. "
            "Outside: between instructions (the engine's own loop). Off CPU: wall time the process was not running "
            "(blocked in a receive or a barrier, or descheduled).", "",
            "| system | schedule | rank | step | F | B | W | BW | other | waits | outside | off CPU |",
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        for i, x in enumerate(r.get("ranks", [])):
            passes = [x.get(k, 0.0) for k in ("ForwardPass_s", "BackwardInput_s", "BackwardWeight_s")]
            bw = x.get("FusedBackward_s", 0.0) + x.get("BackwardPass_s", 0.0)
            out.append(f"| {r['system']} | {r['schedule']} | {i} | {x['step_s']:.3f} | "
                       + " | ".join(f"{v:.3f}" for v in (*passes, bw, x["other_s"], x["waits_s"], x["outside_s"], x["off_cpu_s"])) + " |")
    out += ["", "## Targets (issue 19)", "", *_targets(rows)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="real-compute report (benchmarks/run_real.sh writes the raw lines)")
    ap.add_argument("--raw", type=Path, default=RAW / "real_p2.jsonl")
    ap.add_argument("--name", default="real", help="writes results/NAME.md and results/NAME.json")
    args = ap.parse_args(argv)
    lines = read_jsonl(args.raw)
    if not lines:
        print(f"no measurements in {args.raw}: run benchmarks/run_real.sh first", file=sys.stderr)
        return 1
    rows = real_rows(lines)
    machine = machine_info(RAW)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = real_markdown(rows, machine)
    variants = next((x["variants"] for x in lines if x["kind"] == "variants"), None)
    notes = []
    if variants:  # what SCHEDULE+NAME rows ran with, after the header paragraph
        notes.append("Variants: " + "; ".join(f"`+{k}`: `pipeline` keys `{json.dumps(v)}`" for k, v in variants.items()) + ".")
    ran = [f"{r['schedule']}: {r['ran']}" for r in rows if r.get("ran") not in (None, r["schedule"].split("+")[0])]
    if ran:  # auto's choice, or an order picked for the costs
        notes.append("Ran: " + "; ".join(ran) + ".")
    if notes:
        head, sep, rest = text.partition("\n\n")
        text = head + sep + "\n\n".join(notes) + "\n\n" + rest
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
