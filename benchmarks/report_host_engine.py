"""Markdown report of ``host_engine.py``'s JSON lines (issue 28, parts b and c).

    python benchmarks/report_host_engine.py benchmarks/results/raw/host_engine.jsonl --md benchmarks/results/host_engine.md

Every figure pools the timed steps of all rounds. CPU figures are the main thread's CPU time
(what the host spent); step times are wall time between barriers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recipes.cores import RankCpu, cpu_share, describe  # noqa: E402

__all__ = ["PASSES", "TRANSFERS", "load", "per_stage", "render", "write_report"]

BASE = "deepspeed-1f1b"
PASSES = ("ForwardPass", "BackwardPass", "FusedBackward", "BackwardInput", "BackwardWeight")
TRANSFERS = ("PostRecvActivation", "PostRecvGrad", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
# DeepSpeed's fused backward is ds_vshape's FusedBackward: the same work under another name.
SAME_AS = {"BackwardPass": "FusedBackward"}
ROWS = ("LoadMicroBatch", "ForwardPass", "FusedBackward", "BackwardInput", "BackwardWeight", *TRANSFERS, "ReduceTiedGrads",
        "ReduceGrads", "OptimizerStep")


Layers = dict[str, dict[str, str]]  # schedule -> model stage -> the layers its cut gives it


def load(path: Path) -> tuple[dict[str, Any], dict[str, list[list[dict[str, Any]]]], dict[str, int], dict[str, Any], Layers]:
    """(setting, per schedule its ranks' timed steps over all rounds, tokens per step, end record, the cut
    per schedule: empty for records from before it was recorded)."""
    setting: dict[str, Any] = {}
    end: dict[str, Any] = {}
    steps: dict[str, list[list[dict[str, Any]]]] = {}
    tokens: dict[str, int] = {}
    layers: Layers = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "setting":
            setting = rec
        elif rec["kind"] == "end":
            end = rec
        elif rec["kind"] == "steps":
            ranks = steps.setdefault(rec["schedule"], [[] for _ in rec["ranks"]])
            for mine, got in zip(ranks, rec["ranks"]):
                mine.extend(got)
            tokens[rec["schedule"]] = rec["tokens_per_step"]
            if "layers" in rec:
                layers[rec["schedule"]] = rec["layers"]
    return setting, steps, tokens, end, layers


def _med(values: Iterable[float]) -> float:
    got = list(values)
    return statistics.median(got) if got else float("nan")


def _name(handler: str) -> str:
    return SAME_AS.get(handler, handler)


def per_call_cpu(ranks: list[list[dict[str, Any]]]) -> dict[str, tuple[float, float]]:
    """Instruction type -> (median over steps of CPU µs per call, calls per step summed over ranks)."""
    out: dict[str, tuple[float, float]] = {}
    names = {_name(h) for rank in ranks for step in rank for h in step["handlers"]}
    for name in names:
        per_step = []
        for steps in zip(*ranks):  # one step, every rank
            calls = sum(h[0] for s in steps for k, h in s["handlers"].items() if _name(k) == name)
            cpu = sum(h[2] for s in steps for k, h in s["handlers"].items() if _name(k) == name)
            if calls:
                per_step.append((1e6 * cpu / calls, calls))
        out[name] = (_med(c for c, _ in per_step), _med(n for _, n in per_step))
    return out


def per_stage(steps: list[dict[str, Any]]) -> dict[int, dict[str, tuple[float, float]]]:
    """One rank's passes per model stage: stage -> pass type -> (median over steps of CPU µs per call,
    median calls per step); pass type ``all`` holds the stage's pass CPU per step (ms, median), calls 0.
    Empty for records without per-stage figures."""
    keys = {k for s in steps for k in s.get("stage_passes", {})}
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for key in keys:
        handler, stage = key.rsplit("@", 1)
        got = [s["stage_passes"][key] for s in steps if s.get("stage_passes", {}).get(key, [0])[0]]
        out.setdefault(int(stage), {})[_name(handler)] = (_med(1e6 * cpu / calls for calls, cpu in got), _med(c for c, _ in got))
    for stage in out:
        mine = [k for k in keys if int(k.rsplit("@", 1)[1]) == stage]
        total = _med(sum(s.get("stage_passes", {}).get(k, [0, 0.0])[1] for k in mine) for s in steps)
        out[stage]["all"] = (1e3 * total, 0.0)
    return out


def rank_split(steps: list[dict[str, Any]]) -> dict[str, float]:
    """One rank's median CPU ms per step: passes, transfers, other instructions, outside them."""
    def part(step: dict[str, Any], names: Iterable[str]) -> float:
        return sum(h[2] for k, h in step["handlers"].items() if k in names)

    rest = lambda s: sum(h[2] for k, h in s["handlers"].items() if k not in PASSES and k not in TRANSFERS)  # noqa: E731
    return {
        "cpu": 1e3 * _med(s["cpu_s"] for s in steps),
        "passes": 1e3 * _med(part(s, PASSES) for s in steps),
        "transfers": 1e3 * _med(part(s, TRANSFERS) for s in steps),
        "other": 1e3 * _med(rest(s) for s in steps),
        "outside": 1e3 * _med(s["cpu_s"] - sum(h[2] for h in s["handlers"].values()) for s in steps),
        "local": 1e3 * _med(s["local_s"] for s in steps),
        "blocked": _med(s.get("blocked", float("nan")) for s in steps),
        "preempted": _med(s.get("preempted", float("nan")) for s in steps),
        **_collector(steps),
    }


def _collector(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Python's collector per step, as means (a collection comes every few steps, so medians read 0):
    its ms, and its collections of the oldest generation (each walks every object the process holds)."""
    runs = [s["gc"] for s in steps if s.get("gc")]
    if not runs:  # raw lines from before the benchmark recorded it
        return {"gc_ms": float("nan"), "gc_full": float("nan")}
    return {"gc_ms": 1e3 * sum(sum(g["seconds"]) for g in runs) / len(runs), "gc_full": sum(g["count"][2] for g in runs) / len(runs)}


def whole_steps(steps: dict[str, list[list[dict[str, Any]]]], tokens: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    for schedule, ranks in steps.items():
        step_s = _med(s["step_s"] for s in ranks[0])
        busiest = max(rank_split(r)["cpu"] for r in ranks)
        rows.append({"schedule": schedule, "step_ms": 1e3 * step_s, "tokens_s": tokens[schedule] / step_s, "cpu_ms": busiest,
                     "load1": _med(s["load1"] for s in ranks[0] if s.get("load1") is not None), "n": len(ranks[0])})
    return rows


def render(path: Path) -> str:
    setting, steps, tokens, end, layers = load(path)
    rows = whole_steps(steps, tokens)
    base = next((r for r in rows if r["schedule"] == BASE), rows[0])
    out = _header(setting, end, steps)
    out += _orders_run(path, steps)
    out += ["## (c) Whole steps", "",
            "Median step time between barriers and tokens/s; the busiest rank's main-thread CPU per step (median), which",
            "other load on the machine inflates far less than the step time. `vs DS` = tokens/s over DeepSpeed 1F1B's;",
            "`CPU vs DS` = DeepSpeed's busiest-rank CPU over this schedule's (above 1: less host work).", "",
            "| schedule | steps | median step (ms) | tokens/s | vs DS | busiest rank CPU/step (ms) | CPU vs DS | load (1 min) |",
            "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        out.append(f"| {r['schedule']} | {r['n']} | {r['step_ms']:.1f} | {r['tokens_s']:,.0f} | {r['tokens_s'] / base['tokens_s']:.2f}x "
                   f"| {r['cpu_ms']:.1f} | {base['cpu_ms'] / r['cpu_ms']:.2f}x | {r['load1']:.1f} |")
    out += ["", "Where each rank's CPU went (ms per step, medians): passes (F, B, W, fused BW), transfers (post, send, receive),",
            "other instructions (load, reduces, optimizer step), and the engine's own work outside any instruction; then the",
            "rank's own step (wall) and how often per step its main thread blocked (waited for a peer or a lock) or was",
            "preempted: after each block the thread must be scheduled again, which on a busy machine costs more than the work.",
            "Last, Python's collector (means per step): its ms, and its full collections (each walks every object the process",
            "holds, the imported libraries' included).", "",
            "| schedule | rank | CPU | passes | transfers | other | outside | rank's step (wall) | blocked | preempted | collector (ms) | full collections |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for schedule, ranks in steps.items():
        for i, r in enumerate(ranks):
            s = rank_split(r)
            out.append(f"| {schedule} | {i} | {s['cpu']:.1f} | {s['passes']:.1f} | {s['transfers']:.1f} | {s['other']:.1f} "
                       f"| {s['outside']:.1f} | {s['local']:.1f} | {s['blocked']:.0f} | {s['preempted']:.0f} | {s['gc_ms']:.2f} "
                       f"| {s['gc_full']:.2f} |")
    return "\n".join(out + [""] + _per_instruction(steps) + [""] + _per_stage_table(steps, layers=layers))


def _per_instruction(steps: dict[str, list[list[dict[str, Any]]]]) -> list[str]:
    calls = {schedule: per_call_cpu(ranks) for schedule, ranks in steps.items()}
    schedules = list(steps)
    out = ["## (b) Host cost per instruction type", "",
           "Main-thread CPU µs per call (median over steps, both ranks), with the calls per step of both ranks in brackets.",
           "DeepSpeed's BackwardPass is the FusedBackward row. On the same stages the passes do the same compute, so the",
           "difference between DeepSpeed 1F1B and ds_vshape 1f1b is the engines' own host work; transfer instructions",
           "are host work alone (DeepSpeed's receives post and wait in one instruction, ds_vshape posts early).", "",
           "| instruction | " + " | ".join(schedules) + " |", "|---|" + "--:|" * len(schedules)]
    for name in ROWS:
        if not any(name in calls[s] for s in schedules):
            continue
        cells = [f"{calls[s][name][0]:,.0f} ({calls[s][name][1]:g})" if name in calls[s] else "" for s in schedules]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def _per_stage_table(steps: dict[str, list[list[dict[str, Any]]]], *, layers: Layers | None = None) -> list[str]:
    rows = [(schedule, rank, stage, kinds) for schedule, ranks in steps.items() for rank, r in enumerate(ranks)
            for stage, kinds in sorted(per_stage(r).items())]
    if not rows:
        return []
    cut = layers or {}
    out = ["## Passes per model stage", "",
           "Each rank's passes by the model stage they run (a V placement runs two per rank, the first and last on rank 0):",
           "the layers the engine's cut gave the stage (the LM head layer holds the final norm; the loss goes with it),",
           "main-thread CPU µs per call (median over steps) with calls per step in brackets, and the stage's passes in ms",
           "per step.", "",
           "| schedule | rank | stage | layers | F | B | W | fused BW | passes per step (ms) |", "|---|--:|--:|---|--:|--:|--:|--:|--:|"]
    for schedule, rank, stage, kinds in rows:
        cells = [f"{kinds[n][0]:,.0f} ({kinds[n][1]:g})" if n in kinds else "" for n in
                 ("ForwardPass", "BackwardInput", "BackwardWeight", "FusedBackward")]
        where = cut.get(schedule, {}).get(str(stage), "?")
        out.append(f"| {schedule} | {rank} | {stage} | {where} | " + " | ".join(cells) + f" | {kinds['all'][0]:.1f} |")
    return out + [""]


def _header(setting: dict[str, Any], end: dict[str, Any], steps: dict[str, Any]) -> list[str]:
    ranks = [RankCpu(r["host"], r["threads"], tuple(r["cpus"])) for r in setting.get("ranks", [])]
    share = cpu_share(ranks)
    v = setting.get("versions", {})
    return [
        "# Engine host cost at p=2: ds_vshape against DeepSpeed's PipelineEngine (issue 28, parts b and c)", "",
        f"**Device and regime:** CPU ({setting.get('cpu', '?')}), {len(ranks)} pipeline ranks of "
        f"{'/'.join(str(t) for t in sorted({r.threads for r in ranks}))} torch thread(s) each"
        f"{describe(share.cores, share.demand, share.rank_cores).split(', so')[0]}; gloo; host-bound tiny shapes: the recipe's "
        f"Llama (hidden 64, 8 blocks, 4 heads, FFN 176, byte vocabulary), sequences of {setting.get('seq_len')}, 8 micro-batches "
        "of 4 rows, AdamW with clipping (`ds_configs/`). Every kernel takes microseconds: the ranks' time is host work.", "",
        f"Command: `make bench-host` (`benchmarks/host_engine.py`). Commit {setting.get('commit', '?')}; torch {v.get('torch')}, DeepSpeed "
        f"{v.get('deepspeed')}, transformers {v.get('transformers')}. Load average (1, 5, 15 min) before "
        f"{setting.get('load_before')}, after {end.get('load_after', '?')}: other work on the machine slows wall times (not "
        "CPU times); the engines take turns step by step, so it falls on all of them alike.", "",
        f"Schedules: {', '.join(steps)} (seq1f1b with 2 sequence chunks). One engine each, built first; per round 2 untimed "
        "and then timed steps each, in turns; the activation meter off.", "",
    ]


def _orders_run(path: Path, steps: dict[str, Any]) -> list[str]:
    """A line naming what a row ran where that is not the row's name alone (auto's choice, an order for costs)."""
    ran: dict[str, set[str]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "steps" and rec.get("ran") not in (None, rec["schedule"].split("+")[0], "DeepSpeed TrainSchedule"):
            ran.setdefault(rec["schedule"], set()).add(rec["ran"])
    if not ran:
        return []
    listed = "; ".join(f"{name}: {', '.join(sorted(ran[name]))}" for name in steps if name in ran)
    return [f"Ran (auto's choice, or the order picked for the costs): {listed}.", ""]


def write_report(raw: Path, md: Path) -> None:
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render(raw))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path)
    ap.add_argument("--md", type=Path, required=True)
    args = ap.parse_args(argv)
    write_report(args.raw, args.md)


if __name__ == "__main__":
    main()
