"""Markdown for ``split_cost.py``'s result: tables, and prose whose figures come from the same result."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import git_commit, machine_brief

__all__ = ["cache_sizes", "load_average", "render"]

CATEGORIES = ("GEMM", "attention", "elementwise", "accumulate", "other")
PAGE = resource.getpagesize()
COLUMNS = ("plain|F", "plain|B", "routed|F", "routed|B", "split|F", "split|B", "split|W")


def cache_sizes() -> str:
    """CPU caches as sysfs lists them for cpu0 (level and size), or "unknown"."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for index in sorted(base.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            if kind != "Instruction":
                sizes.append(f"L{(index / 'level').read_text().strip()} {(index / 'size').read_text().strip()}")
        except OSError:
            continue
    return ", ".join(sizes) or "unknown"


def _header(result: dict[str, Any]) -> list[str]:
    info, args = machine_brief(), result["args"]
    return ["# What split backward costs on real compute (`benchmarks/split_cost.py`)", "",
            (f"Command: `OMP_NUM_THREADS=1 {result['command'].strip()}`; commit {result.get('commit') or git_commit()}; "
            f"torch {result.get('torch', torch.__version__)}."),
            (f"Machine: {info.get('cpu', 'unknown')}, {info.get('cores', '?')} cores (caches of cpu0: {cache_sizes()}); "
            f"one thread (`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')}`, `torch.set_num_threads(1)`); "
            f"load average {result['load_start']} at the start, {load_average()} at the end; the run took {result['wall_s']:.0f} s."),
            (f"Stage: Llama hidden {args['hidden']}, FFN {args['ffn']}, {args['heads']} heads, sdpa, 4 sequences of "
            f"{args['seq_len']}; {result['stage']}. {args['reps']} timed reps after {args['warmup']} warm-up, "
            "each mode once per rep, the order rotating."), ""]


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _timing(summary: dict[str, dict[str, float]]) -> list[str]:
    base = summary["plain"]["total"]
    lines = ["## Median time per pass (ms) and minor page faults per pass", "",
             ("Wall time; `CPU` is the process's CPU time, which time the core spent on other processes does not "
             "inflate; `min` the fastest rep's F+B+W."), "",
             "| mode | F | B | W | F+B+W | vs plain | min F+B+W | vs plain | CPU F+B+W | vs plain | faults F | faults B | faults W |",
             "|---|" + "--:|" * 12]
    low, cpu = summary["plain"]["total_min"], summary["plain"]["total_cpu"]
    for mode, row in summary.items():
        lines.append(f"| {mode} | {row['F']:.1f} | {row['B']:.1f} | {row['W']:.1f} | {row['total']:.1f} | {row['total'] / base:.3f} "
                     f"| {row['total_min']:.1f} | {row['total_min'] / low:.3f} | {row['total_cpu']:.1f} | {row['total_cpu'] / cpu:.3f} "
                     f"| {row['faults_F']:.0f} | {row['faults_B']:.0f} | {row['faults_W']:.0f} |")
    split, routed, plain = summary["split"], summary["routed"], summary["plain"]
    faults = {m: sum(r[f"faults_{p}"] for p in "FBW") for m, r in summary.items()}
    lines += ["", (f"In this run split F+B+W took {split['total']:.1f} ms against plain F+B's {plain['total']:.1f} ms "
              f"({(split['total'] / plain['total'] - 1) * 100:+.1f} %; fastest reps {(split['total_min'] / low - 1) * 100:+.1f} %, "
              f"CPU time {(split['total_cpu'] / cpu - 1) * 100:+.1f} %); the routing alone, backward fused "
              f"(`routed`), {(routed['total'] / plain['total'] - 1) * 100:+.1f} %. Split's B+W "
              f"({split['B'] + split['W']:.1f} ms) against plain B ({plain['B']:.1f} ms): "
              f"{split['B'] + split['W'] - plain['B']:+.1f} ms; its F against plain F: {split['F'] - plain['F']:+.1f} ms. "
              f"Minor page faults per micro-batch: plain {faults['plain']:.0f}, routed {faults['routed']:.0f}, "
              f"split {faults['split']:.0f} ({faults['split'] * PAGE / 2**20:.1f} MiB of fresh {PAGE // 1024} KiB pages; "
              f"split B leaves {split['parked_mib']:.1f} MiB parked for W)."), ""]
    return lines


def _cell(cats: dict[str, list[float]], cat: str) -> str:
    ms, calls = cats.get(cat, [0.0, 0.0])
    return f"{ms:.1f} ({calls:.0f})" if calls or abs(ms) >= 0.05 else "-"


def _sum(prof: dict[str, Any], mode: str, cat: str) -> tuple[float, float]:
    cells = [prof["categories"].get(f"{mode}|{p}", {}).get(cat, [0.0, 0.0]) for p in "FBW"]
    return sum(c[0] for c in cells), sum(c[1] for c in cells)


def _categories(prof: dict[str, Any], reps: int) -> list[str]:
    lines = [f"## Profile: self time per pass by category, ms (calls), median of {reps} profiled reps", "",
             ("Each operator's self time goes to the pass whose window it starts in; `other` is the pass's wall "
             "time minus the categorised operators: Python (ds_vshape's routing and parking included), autograd's "
             "engine and dispatch. The profiler adds its own cost to every call."), "",
             "| category | " + " | ".join(c.replace("|", " ") for c in COLUMNS) + " | plain F+B | split F+B+W | split - plain |", "|---|" + "--:|" * 10]
    for cat in CATEGORIES:
        plain, split = _sum(prof, "plain", cat), _sum(prof, "split", cat)
        row = [_cell(prof["categories"].get(col, {}), cat) for col in COLUMNS]
        lines.append(f"| {cat} | " + " | ".join(row) + f" | {plain[0]:.1f} ({plain[1]:.0f}) | {split[0]:.1f} ({split[1]:.0f}) "
                     f"| {split[0] - plain[0]:+.1f} |")
    total = {m: sum(_sum(prof, m, c)[0] for c in CATEGORIES) for m in ("plain", "split")}
    diffs = {c: _sum(prof, "split", c)[0] - _sum(prof, "plain", c)[0] for c in CATEGORIES}
    calls = {c: (_sum(prof, "plain", c)[1], _sum(prof, "split", c)[1]) for c in CATEGORIES}
    same = [c for c in CATEGORIES if c != "other" and round(calls[c][0]) == round(calls[c][1])]
    differ = [f"{c} {calls[c][0]:.0f} vs {calls[c][1]:.0f}" for c in CATEGORIES if c != "other" and c not in same]
    order = sorted(diffs, key=lambda c: -diffs[c])
    lines += ["", f"Profiled, split F+B+W took {total['split']:.1f} ms against plain's {total['plain']:.1f} ms "
              f"({total['split'] - total['plain']:+.1f} ms); by category: "
              + ", ".join(f"{c} {diffs[c]:+.1f} ms" for c in order) + ". "
              + f"Calls per micro-batch equal in plain and split for: {', '.join(same) or 'none'}"
              + (f"; different: {', '.join(differ)}." if differ else "."), ""]
    return lines


def _operators(prof: dict[str, Any], top: int = 12) -> list[str]:
    def total(mode: str, name: str) -> tuple[float, float]:
        cells = [prof["ops"].get(f"{mode}|{p}", {}).get(name, [0.0, 0.0]) for p in "FBW"]
        return sum(c[0] for c in cells), sum(c[1] for c in cells)

    names = {n for label in prof["ops"] for n in prof["ops"][label] if label.split("|")[0] in ("plain", "split")}
    ranked = sorted(names, key=lambda n: -abs(total("split", n)[0] - total("plain", n)[0]))[:top]
    lines = [f"## Operators with the largest split - plain difference (ms per micro-batch, calls; medians; top {top})", "",
             "| operator | plain F | plain B | split F | split B | split W | plain ms/call | split ms/call | split - plain |",
             "|---|" + "--:|" * 8]
    for n in ranked:
        cells = [prof["ops"].get(col, {}).get(n) for col in ("plain|F", "plain|B", "split|F", "split|B", "split|W")]
        shown = [f"{c[0]:.2f} ({c[1]:.0f})" if c else "-" for c in cells]
        (pm, pc), (sm, sc) = total("plain", n), total("split", n)
        lines.append(f"| {n} | " + " | ".join(shown) + f" | {pm / pc if pc else 0:.3f} | {sm / sc if sc else 0:.3f} | {sm - pm:+.2f} |")
    return lines + ["", _gemm_sentence(prof), ""]


def _gemm_sentence(prof: dict[str, Any]) -> str:
    """W's GEMMs against the weight-gradient share of plain B's, estimated (the table cannot tell them apart)."""
    def mm(label: str) -> list[float]:
        return prof["ops"].get(label, {}).get("aten::mm", [0.0, 0.0])

    plain_b, split_b, split_w = mm("plain|B"), mm("split|B"), mm("split|W")
    estimate = plain_b[0] - split_b[0]
    if not split_w[1] or estimate <= 0:
        return "No `aten::mm` in W in this run."
    return (f"`aten::mm` in W: {split_w[0]:.1f} ms for {split_w[1]:.0f} calls. Plain B's `aten::mm` minus split B's, i.e. "
            f"the weight-gradient GEMMs inside a fused backward if the input-gradient GEMMs cost the same in both: "
            f"{estimate:.1f} ms; W's took {(split_w[0] / estimate - 1) * 100:+.1f} % of that.")


def _gemms(rows: list[dict[str, Any]], evict_mib: int) -> list[str]:
    lines = [f"## GEMM control: weight-gradient GEMMs alone, hot vs cold operands ({evict_mib} MiB written before each cold call)", "",
             "Median CPU ms per call.", "",
             "| GEMM | shape | hot (ms) | cold (ms) | cold / hot |", "|---|---|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['gemm']} | {r['shape']} | {r['hot_ms']:.3f} | {r['cold_ms']:.3f} | {r['cold_ms'] / r['hot_ms']:.3f} |")
    ratios = [r["cold_ms"] / r["hot_ms"] for r in rows]
    lines += ["", (f"In this run, operands no longer in the cache made these GEMMs {(min(ratios) - 1) * 100:+.1f} % to "
              f"{(max(ratios) - 1) * 100:+.1f} % slower than the same call on operands just read."), ""]
    return lines


def render(result: dict[str, Any]) -> str:
    args = result["args"]
    parts = (_header(result) + _timing(result["summary"]) + _categories(result["profile"], args["profile_reps"])
             + _operators(result["profile"]) + _gemms(result["gemm_control"], args["evict_mib"]))
    return "\n".join(parts)
