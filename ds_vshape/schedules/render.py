"""Presentation of schedules and simulations: ASCII timeline, Chrome trace, PNG plot, tables.

Pure like the rest of the schedule layer: matplotlib is imported inside ``plot_timeline``
only, so the CLI's ``export`` and ``compare`` (and the runtime) never pay for it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .costs import Costs
from .ir import Action, Kind, Schedule
from .registry import generate, get_info, schedule_names
from .simulate import SimResult, simulate

__all__ = [
    "ascii_timeline",
    "chrome_trace",
    "plot_timeline",
    "draw_boxes",
    "style_axes",
    "compare_rows",
    "format_table",
    "rank_rows",
    "BASELINE",
]

# Every ratio in the tables is taken against DeepSpeed's own schedule at the same p, m.
BASELINE = "1f1b"

# Distinct hues per pass kind (Okabe-Ito palette: readable for colour-blind viewers).
_COLOURS: dict[Kind, str] = {
    Kind.F: "#0072B2",  # blue
    Kind.B: "#E69F00",  # orange
    Kind.W: "#009E73",  # green
    Kind.BW: "#D55E00",  # vermilion
}
# One character per kind for compressed ASCII rows; BW needs its own letter.
_GLYPHS: dict[Kind, str] = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}
_KIND_NAMES: dict[Kind, str] = {
    Kind.F: "F  forward",
    Kind.B: "B  input grad",
    Kind.W: "W  weight grad",
    Kind.BW: "BW fused backward",
}


# ---- ASCII --------------------------------------------------------------------------------
def ascii_timeline(result: SimResult, schedule: Schedule, *, width: int | None = None, max_width: int = 160) -> str:
    """One row per rank, time scaled to characters; '.' marks idle time.

    Each action fills the columns of its time span with the longest label that fits:
    ``F12.1`` (kind, micro-batch, seq chunk when k > 1), then ``F12``; failing both, one
    glyph per column (F/B/W, X for BW; lower case for odd micro-batches).
    ``width=None`` picks a whole number of characters per shortest pass (so equal passes
    get equal boxes) such that the row stays within ``max_width``.
    """
    width = _auto_width(result, schedule, max_width) if width is None else width
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    scale = width / result.makespan if result.makespan > 0 else 0.0
    label_width = len(f"rank {schedule.stages - 1}")
    lines = [_axis_line(result.makespan, width, label_width)]
    for rank, events in enumerate(result.timeline):
        row = _ascii_row(events, scale, width, seq_chunks=schedule.seq_chunks)
        lines.append(f"{f'rank {rank}'.rjust(label_width)} |{row}|")
    lines.append(f"{' ' * label_width}  1 char = {result.makespan / width:.3g} time units; '.' idle; "
                 "where no number fits: F/B/W, X = BW, lower case = odd micro-batch")
    return "\n".join(lines)


def _auto_width(result: SimResult, schedule: Schedule, max_width: int) -> int:
    durations = [end - start for t in result.timeline for start, end, _ in t if end > start]
    if not durations or result.makespan <= 0:
        return max(1, min(max_width, 40))
    quantum = min(durations)
    slots = result.makespan / quantum
    # Room for the widest label of a shortest pass plus a separating blank, when it fits.
    wanted = len(f"F{schedule.micro_batches - 1}") + 1 + (2 if schedule.seq_chunks > 1 else 0)
    per_slot = min(wanted, math.floor(max_width / slots + 1e-9))
    if per_slot < 1:
        return max_width
    return max(1, math.ceil(slots * per_slot - 1e-9))


def _axis_line(makespan: float, width: int, label_width: int) -> str:
    right = f"{makespan:g}"
    return f"{'t'.rjust(label_width)}  0{right.rjust(max(width - 1, len(right)))}"


def _ascii_row(events: Sequence[tuple[float, float, Action]], scale: float, width: int, *, seq_chunks: int) -> str:
    row = ["."] * width
    for start, end, action in events:
        # Half-up rounding of both ends: boxes of equal duration get equal widths.
        lo = min(math.floor(start * scale + 0.5), width - 1)
        # Every action gets at least one column so that short W passes never vanish.
        hi = min(max(math.floor(end * scale + 0.5), lo + 1), width)
        row[lo:hi] = _fit_label(action, hi - lo, seq_chunks=seq_chunks)
    return "".join(row)


def _fit_label(action: Action, span: int, *, seq_chunks: int) -> str:
    kind = action.kind.value
    options = [f"{kind}{action.micro_batch}"]
    if seq_chunks > 1:
        options.insert(0, f"{kind}{action.micro_batch}.{action.seq_chunk}")
    for text in options:
        if len(text) <= span:
            # Blank padding separates neighbours (``F1 F2``) whenever there is room for it.
            return text.ljust(span)
    # No room for a number: fill with one glyph, lower case for odd micro-batches, so that
    # neighbouring passes stay apart even at one column each (``FfFfXxXx``).
    glyph = _GLYPHS[action.kind]
    return (glyph.lower() if action.micro_batch % 2 else glyph) * span


# ---- Chrome trace -------------------------------------------------------------------------
def chrome_trace(result: SimResult, schedule: Schedule, *, time_unit_us: float = 1000.0) -> dict[str, Any]:
    """Chrome trace event JSON (open in https://ui.perfetto.dev or chrome://tracing).

    One process, one thread per rank, one complete ('X') event per action. The simulator's
    time unit is abstract, so one unit is drawn as ``time_unit_us`` microseconds.
    """
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": _title(schedule)}},
    ]
    for rank, timeline in enumerate(result.timeline):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}})
        events.extend(_trace_event(rank, start, end, action, time_unit_us) for start, end, action in timeline)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": schedule.name,
            "stages": schedule.stages,
            "micro_batches": schedule.micro_batches,
            "chunks_per_rank": schedule.chunks_per_rank,
            "seq_chunks": schedule.seq_chunks,
            "makespan": result.makespan,
            "bubble_rate": result.bubble_rate,
            "time_unit_us": time_unit_us,
        },
    }


def _trace_event(rank: int, start: float, end: float, action: Action, unit_us: float) -> dict[str, Any]:
    return {
        "name": str(action),
        "cat": action.kind.value,
        "ph": "X",
        "pid": 0,
        "tid": rank,
        "ts": start * unit_us,
        "dur": (end - start) * unit_us,
        "args": {
            "kind": action.kind.value,
            "stage": action.stage,
            "micro_batch": action.micro_batch,
            "seq_chunk": action.seq_chunk,
        },
    }


def _title(schedule: Schedule) -> str:
    return (
        f"{schedule.name}  p={schedule.stages} m={schedule.micro_batches} "
        f"v={schedule.chunks_per_rank} k={schedule.seq_chunks}"
    )


# ---- PNG plot -----------------------------------------------------------------------------
def plot_timeline(result: SimResult, schedule: Schedule, path: str | Path, *, dpi: int = 150) -> Path:
    """Draw ranks against time as coloured boxes, micro-batch numbers inside, to a PNG.

    Uses the Agg canvas directly (no pyplot), so it never touches a caller's GUI backend.
    A rank's later model chunks (v > 1) are drawn lighter, so V-shapes can be read off.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width_in, height_in = _figure_size(result, schedule)
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    draw_boxes(ax, result, schedule)
    handles = style_axes(ax, result, schedule)
    # The legend sits in its own strip under the axis; tight_layout keeps the rest clear of it.
    legend_frac = 0.4 / height_in
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9)
    fig.tight_layout(rect=(0.0, legend_frac, 1.0, 1.0))
    out = Path(path)
    fig.savefig(out)
    return out


def _figure_size(result: SimResult, schedule: Schedule) -> tuple[float, float]:
    """About a quarter inch per shortest pass, so every box can carry its number."""
    durations = [end - start for t in result.timeline for start, end, _ in t if end > start]
    slots = result.makespan / min(durations) if durations and result.makespan > 0 else 10.0
    return min(max(10.0, 0.24 * slots + 1.5), 36.0), 1.6 + 0.55 * schedule.stages


def draw_boxes(ax: Any, result: SimResult, schedule: Schedule) -> None:
    """One box per pass on a matplotlib axis, rank per row, numbered where the number fits.

    Public with ``style_axes`` so that other figures (``benchmarks/report_auto_plots.py``) draw
    timelines the way ``plot_timeline`` does, on axes of their own.
    """
    fig = ax.get_figure()
    # Points per time unit along x, from the axis' share of the figure width (~85%).
    pt_per_unit = fig.get_figwidth() * 72 * 0.85 / (result.makespan or 1.0)
    row_pt = fig.get_figheight() * 72 / (schedule.stages + 2)
    chunk_of = {s: idx for r in range(schedule.stages) for idx, s in enumerate(schedule.stages_of_rank(r))}
    for rank, timeline in enumerate(result.timeline):
        for start, end, action in timeline:
            alpha = 1.0 - 0.5 * chunk_of[action.stage] / max(schedule.chunks_per_rank - 1, 1)
            ax.barh(rank, end - start, left=start, height=0.8, color=_COLOURS[action.kind], alpha=alpha,
                    edgecolor="black", linewidth=0.4)
            text = str(action.micro_batch) if schedule.seq_chunks == 1 else f"{action.micro_batch}.{action.seq_chunk}"
            size = _fontsize(text, (end - start) * pt_per_unit, row_pt)
            if size:
                ax.text((start + end) / 2, rank, text, ha="center", va="center", fontsize=size,
                        color="white" if alpha > 0.7 else "black", fontweight="bold")


def _fontsize(text: str, box_pt: float, row_pt: float) -> float:
    """Largest font from 9 down to 5 pt whose text fits the box; 0 when none does."""
    for size in (9.0, 8.0, 7.0, 6.0, 5.0):
        # Bold digits are ~0.62 em wide; keep a little margin inside the box edges.
        if 0.62 * size * len(text) + 2.0 <= box_pt and size <= row_pt * 0.5:
            return size
    return 0.0


def style_axes(ax: Any, result: SimResult, schedule: Schedule) -> list[Any]:
    """Ticks, limits, title and grid; returns the legend handles (kinds present, chunk shade)."""
    from matplotlib.patches import Patch

    ax.set_yticks(range(schedule.stages), [f"rank {r}" for r in range(schedule.stages)])
    ax.set_ylim(schedule.stages - 0.5, -0.5)  # rank 0 on top, as in the papers
    ax.set_xlim(0, result.makespan or 1.0)
    ax.set_xlabel("time (cost units)")
    ax.set_title(
        f"{schedule.name}: p={schedule.stages}, m={schedule.micro_batches}, v={schedule.chunks_per_rank}, "
        f"k={schedule.seq_chunks}  |  makespan {result.makespan:g}, bubble rate {result.bubble_rate:.1%}, "
        f"peak memory {result.max_peak_memory:g} M_B"
    )
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_axisbelow(True)
    kinds = [k for k in Kind if any(a.kind is k for t in result.timeline for _, _, a in t)]
    handles = [Patch(facecolor=_COLOURS[k], edgecolor="black", label=_KIND_NAMES[k]) for k in kinds]
    if schedule.chunks_per_rank > 1:
        handles.append(Patch(facecolor="#888888", edgecolor="black", alpha=0.5, label="lighter = later chunk on the rank"))
    return handles


# ---- comparison tables --------------------------------------------------------------------
def compare_rows(
    p: int,
    m: int,
    *,
    costs: Costs | None = None,
    chunks: int | None = None,
    seq_chunks: int | None = None,
    memory_limit: float | None = None,
    w_memory: float | None = None,
    kept_until_w: float | None = None,
) -> list[dict[str, Any]]:
    """One row per registered schedule at (p, m), with ratios to 1F1B.

    ``chunks``, ``seq_chunks`` and ``memory_limit`` are passed only to the schedules that
    take them, so one call covers every schedule. A schedule that cannot serve (p, m)
    gets a row whose ``error`` says why instead of aborting the whole comparison.
    ``w_memory`` (default ``costs.w_memory``) is the share of an activation B keeps until
    W: the split-backward schedules plan for it, and memory is counted with it unless
    ``kept_until_w`` asks for another share (what if the runtime keeps more than planned).
    """
    costs = costs or Costs()
    if w_memory is not None:
        costs = dataclasses.replace(costs, w_memory=w_memory)
    base = _try_simulate(BASELINE, p, m, costs=costs, kept_until_w=kept_until_w, options={})
    base_result = base[1] if isinstance(base, tuple) else None
    rows = []
    for name in schedule_names():
        options = _applicable_options(name, chunks=chunks, seq_chunks=seq_chunks, memory_limit=memory_limit)
        outcome = _try_simulate(name, p, m, costs=costs, kept_until_w=kept_until_w, options=options)
        rows.append(_row(name, outcome, base_result))
    return rows


def _applicable_options(name: str, *, chunks: int | None, seq_chunks: int | None, memory_limit: float | None) -> dict[str, Any]:
    info = get_info(name)
    options: dict[str, Any] = {}
    if chunks is not None and info.fixed_chunks is None:
        options["chunks"] = chunks
    if seq_chunks is not None and info.seq_chunks:
        options["seq_chunks"] = seq_chunks
    if memory_limit is not None and info.memory_limit:
        options["memory_limit"] = memory_limit
    return options


def _try_simulate(
    name: str, p: int, m: int, *, costs: Costs, kept_until_w: float | None, options: dict[str, Any]
) -> tuple[Schedule, SimResult] | str:
    """(schedule, result), or the one-line reason it cannot run."""
    try:
        schedule = generate(name, p, m, costs=costs, **options)
    except ValueError as err:  # includes ScheduleError: a broken generator must not sink the table
        return str(err).splitlines()[0]
    return schedule, simulate(schedule, costs, kept_until_w=kept_until_w)


def _row(name: str, outcome: tuple[Schedule, SimResult] | str, base: SimResult | None) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "v": None, "k": None, "makespan": None, "bubble_rate": None,
                           "peak_memory": None, "makespan_ratio": None, "memory_ratio": None, "error": None}
    if isinstance(outcome, str):
        row["error"] = outcome
        return row
    schedule, result = outcome
    row.update(
        v=schedule.chunks_per_rank,
        k=schedule.seq_chunks,
        makespan=result.makespan,
        bubble_rate=result.bubble_rate,
        peak_memory=result.max_peak_memory,
        makespan_ratio=_ratio(result.makespan, base.makespan if base else None),
        memory_ratio=_ratio(result.max_peak_memory, base.max_peak_memory if base else None),
    )
    return row


def _ratio(value: float, reference: float | None) -> float | None:
    if reference is None or reference == 0:
        return None
    return value / reference


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (row key, header, alignment)
    ("name", "schedule", "<"),
    ("v", "v", ">"),
    ("k", "k", ">"),
    ("makespan", "makespan", ">"),
    ("bubble_rate", "bubble", ">"),
    ("peak_memory", "peak mem (M_B)", ">"),
    ("makespan_ratio", "time vs 1f1b", ">"),
    ("memory_ratio", "mem vs 1f1b", ">"),
    ("error", "note", "<"),
)


def format_table(rows: Sequence[dict[str, Any]], *, style: str = "markdown") -> str:
    """Aligned table of ``compare_rows`` output; ``style`` is 'markdown' or 'text'.

    The markdown form is padded too, so it reads well in a terminal and pastes into a README.
    The 'note' column is dropped when no row has an error.
    """
    if style not in ("markdown", "text"):
        raise ValueError(f"table style must be 'markdown' or 'text', got {style!r}")
    columns = [c for c in _COLUMNS if c[0] != "error" or any(r.get("error") for r in rows)]
    cells = [[_cell(key, row.get(key)) for key, _, _ in columns] for row in rows]
    headers = [header for _, header, _ in columns]
    widths = [max([len(h)] + [len(line[i]) for line in cells]) for i, h in enumerate(headers)]
    aligns = [align for _, _, align in columns]
    if style == "markdown":
        return _markdown(headers, cells, widths, aligns)
    return _text(headers, cells, widths, aligns)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "" if key == "error" else "-"
    if key == "bubble_rate":
        return f"{value:.1%}"
    if key in ("makespan_ratio", "memory_ratio"):
        return f"{value:.2f}x"
    if isinstance(value, float):
        return f"{value:.2f}" if not math.isinf(value) else "inf"
    return str(value)


def _markdown(headers: list[str], cells: list[list[str]], widths: list[int], aligns: list[str]) -> str:
    def line(values: list[str]) -> str:
        return "| " + " | ".join(f"{v:{a}{w}}" for v, w, a in zip(values, widths, aligns)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == ">" else ("-" * (w + 2)) for w, a in zip(widths, aligns)) + "|"
    return "\n".join([line(headers), rule] + [line(c) for c in cells])


def _text(headers: list[str], cells: list[list[str]], widths: list[int], aligns: list[str]) -> str:
    def line(values: list[str]) -> str:
        return "  ".join(f"{v:{a}{w}}" for v, w, a in zip(values, widths, aligns)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(c) for c in cells])


def rank_rows(result: SimResult, baseline: SimResult | None = None) -> str:
    """Per-rank busy, idle, bubble and peak memory, with the baseline's peak alongside."""
    headers = ["rank", "busy", "idle", "bubble", "peak mem (M_B)", "1f1b peak", "mem vs 1f1b"]
    cells = []
    for r, (busy, idle, rate, peak) in enumerate(zip(result.busy, result.idle, result.bubble_rates, result.peak_memory)):
        ref = baseline.peak_memory[r] if baseline is not None and r < len(baseline.peak_memory) else None
        ratio = _ratio(peak, ref)
        cells.append([str(r), f"{busy:.2f}", f"{idle:.2f}", f"{rate:.1%}", f"{peak:.2f}",
                      "-" if ref is None else f"{ref:.2f}", "-" if ratio is None else f"{ratio:.2f}x"])
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    return _text(headers, cells, widths, [">"] * len(headers))
