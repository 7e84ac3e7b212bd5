"""Side-by-side table of train_hf.py runs, one column per run.

    python recipes/compare_runs.py runs/default/1f1b.jsonl runs/default/v-half.jsonl

Reads each ``--metrics-out`` JSONL file (one object per step) and, when present, the
``<name>.summary.json`` that train_hf.py writes next to it (schedule, simulated bubble,
held-out loss). Each later run gets a column over the first. Step times and tokens/s are medians
over the steps that ran without the activation meter (train_hf.py meters only the first and the
last step: its hooks cost host time that stock DeepSpeed does not pay).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as a script from a plain checkout

from recipes.cores import describe  # noqa: E402

__all__ = ["Run", "load_run", "table", "main"]


@dataclass(frozen=True)
class Run:
    """What one run measured; None where the run did not record it."""

    name: str
    steps: int
    final_loss: float
    median_step_s: float
    median_tokens_per_s: float
    sim_bubble_rate: float | None
    val_loss: float | None
    peak_bytes: tuple[int | None, ...]  # per pipeline rank, max over the steps
    setting: dict[str, Any]  # what was measured on: model, size, device, processes, cores


def load_run(path: Path) -> Run:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no steps")
    side = path.with_name(path.stem + ".summary.json")
    summary: dict[str, Any] = json.loads(side.read_text()) if side.exists() else {}
    timed = _timed_rows(rows)
    return Run(
        name=summary.get("schedule", path.stem),
        steps=rows[-1]["step"],
        final_loss=rows[-1]["loss"],
        median_step_s=statistics.median(r["step_time_s"] for r in timed),
        median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        sim_bubble_rate=summary.get("sim_bubble_rate"),
        val_loss=summary.get("val_loss"),
        peak_bytes=_peaks(rows),
        setting={k: summary[k] for k in ("model", "size", "device", "world", "cores", "cpu_demand", "rank_cores", "micro_batches")
                 if k in summary},
    )


def _timed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps the medians are taken over: those without the activation meter when there are any.

    train_hf.py meters the first and the last step only (the meter's hooks cost host time that the
    stock engine does not pay); rows written before it said so were all metered."""
    plain = [r for r in rows if not r.get("metered", True)]
    return plain or rows


def _peaks(rows: list[dict[str, Any]]) -> tuple[int | None, ...]:
    ranks = len(rows[0]["peak_activation_bytes"])
    out: list[int | None] = []
    for r in range(ranks):
        seen = [row["peak_activation_bytes"][r] for row in rows if row["peak_activation_bytes"][r] is not None]
        out.append(max(seen) if seen else None)
    return tuple(out)


# ---- formatting -------------------------------------------------------------------------------
Cell = Callable[[Run], float | None]


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def _rows(runs: Sequence[Run]) -> list[tuple[str, Cell, Callable[[float | None], str]]]:
    """(label, value getter, formatter) for every line of the table."""
    ranks = max(len(r.peak_bytes) for r in runs)
    rows: list[tuple[str, Cell, Callable[[float | None], str]]] = [
        ("loss at end", lambda r: r.final_loss, lambda v: f"{v:.4f}"),
        ("held-out loss", lambda r: r.val_loss, lambda v: f"{v:.4f}"),
        ("median step time", lambda r: r.median_step_s, lambda v: f"{v:.3f} s"),
        ("median tokens/s", lambda r: r.median_tokens_per_s, lambda v: f"{v:,.0f}"),
        ("simulated bubble", lambda r: r.sim_bubble_rate, lambda v: f"{v:.1%}"),
    ]
    for rank in range(ranks):
        rows.append((f"peak activations r{rank}", _peak_of(rank), _mib))
    rows.append(("peak activations max", _max_peak, _mib))
    return rows


def _peak_of(rank: int) -> Cell:
    return lambda r: r.peak_bytes[rank] if rank < len(r.peak_bytes) else None


def _max_peak(run: Run) -> float | None:
    seen = [p for p in run.peak_bytes if p is not None]
    return max(seen) if seen else None


def table(runs: Sequence[Run]) -> str:
    """One column per run, then each later run over the first."""
    header = ["", *(f"{r.name} ({r.steps} steps)" for r in runs), *(f"{r.name} / {runs[0].name}" for r in runs[1:])]
    lines = [header]
    for label, get, fmt in _rows(runs):
        values = [get(r) for r in runs]
        cells = [label, *("n/a" if v is None else fmt(v) for v in values)]
        a = values[0]
        cells += [f"{b / a:.2f}x" if a and b is not None else "" for b in values[1:]]
        lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = [" | ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="--metrics-out JSONL files of train_hf.py")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(p) for p in args.metrics]
    except (OSError, ValueError, KeyError) as err:
        print(f"compare_runs.py: error: {err}", file=sys.stderr)
        return 2
    print(setting_line(runs))
    print(table(runs))
    return 0


def setting_line(runs: Sequence[Run]) -> str:
    """What the step times measured: ranks with cores of their own show idle time, shared cores hide it."""
    s = runs[0].setting
    if not s:
        return "measured on: unknown (no summary files next to the metrics)"
    world, cores, device = s.get("world", 0), s.get("cores", 0), s.get("device", "?")
    line = (f"measured on: {s.get('model')} ({s.get('size', 'tiny')} size), {s.get('micro_batches')} micro-batches per step, "
            f"{world} ranks on {device}")
    if device != "cpu":
        return line
    # Summaries written before the per-rank threads were recorded: one thread per rank, as the recipe sets.
    rank_cores = s.get("rank_cores") or [1] * world
    return line + describe(cores, s.get("cpu_demand") or sum(rank_cores), rank_cores)


if __name__ == "__main__":
    sys.exit(main())
