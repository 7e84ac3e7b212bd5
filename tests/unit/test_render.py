"""ASCII timeline, Chrome trace, PNG plot and comparison tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_vshape.schedules import Costs, Schedule, SimResult, generate, linear, schedule_names, simulate
from ds_vshape.schedules.render import (
    ascii_timeline,
    chrome_trace,
    compare_rows,
    format_table,
    plot_timeline,
    rank_rows,
)


def _run(name: str = "1f1b", p: int = 4, m: int = 8, **kwargs: object) -> tuple[Schedule, SimResult]:
    schedule = generate(name, p, m, **kwargs)  # type: ignore[arg-type]
    return schedule, simulate(schedule)


def test_render_module_does_not_import_matplotlib() -> None:
    # The CLI's export/compare must stay cheap: matplotlib only inside plot_timeline.
    import ds_vshape.schedules.render as render

    source = Path(render.__file__).read_text()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not any("matplotlib" in line for line in top_level)
    assert not any(mod in source for mod in ("import torch", "import deepspeed"))


def test_ascii_timeline_rows_and_labels() -> None:
    schedule, result = _run()
    text = ascii_timeline(result, schedule)
    rows = [line for line in text.splitlines() if line.lstrip().startswith("rank")]
    assert len(rows) == 4
    assert all(row.count("|") == 2 for row in rows)
    assert len({len(row) for row in rows}) == 1  # all ranks on one time scale
    assert "F0" in rows[0] and "BW0" in rows[0]
    assert rows[3].split("|")[1].startswith(".")  # the last rank waits for the first forward


def test_ascii_timeline_idle_share_matches_bubble() -> None:
    schedule, result = _run("gpipe", 4, 4)
    text = ascii_timeline(result, schedule, width=120)
    body = "".join(line.split("|")[1] for line in text.splitlines() if line.lstrip().startswith("rank"))
    assert len(body) == 4 * 120
    assert body.count(".") / len(body) == pytest.approx(result.bubble_rate, abs=0.03)


def test_ascii_timeline_narrow_width_still_renders() -> None:
    schedule, result = _run("1f1b", 8, 64)
    text = ascii_timeline(result, schedule, width=20)
    rows = [line for line in text.splitlines() if line.lstrip().startswith("rank")]
    assert len(rows) == 8 and all(len(row.split("|")[1]) == 20 for row in rows)
    with pytest.raises(ValueError):
        ascii_timeline(result, schedule, width=0)


def test_ascii_timeline_shows_seq_chunks() -> None:
    lines = ["0F0.0 0F0.1 0BW0.1 0BW0.0", "1F0.0 1F0.1 1BW0.1 1BW0.0"]
    schedule = Schedule.from_text(lines, name="seq", micro_batches=1, stage_to_rank=linear(2), seq_chunks=2)
    text = ascii_timeline(simulate(schedule), schedule, width=60)
    assert "F0.1" in text and "BW0.0" in text


def test_chrome_trace_events() -> None:
    schedule, result = _run()
    trace = json.loads(json.dumps(chrome_trace(result, schedule)))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(len(r) for r in schedule.ranks)
    assert {e["tid"] for e in complete} == set(range(4))
    assert {e["pid"] for e in trace["traceEvents"]} == {0}
    first = next(e for e in complete if e["tid"] == 0)
    assert first["name"] == "0F0" and first["ts"] == 0 and first["dur"] > 0
    assert set(first["args"]) >= {"stage", "micro_batch", "seq_chunk"}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {f"rank {r}" for r in range(4)}
    end = max(e["ts"] + e["dur"] for e in complete)
    assert end == pytest.approx(result.makespan * 1000.0)


def test_plot_timeline_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    schedule, result = _run("1f1b", 4, 16)
    out = plot_timeline(result, schedule, tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5_000


def test_compare_rows_cover_every_schedule() -> None:
    rows = compare_rows(4, 16, costs=Costs())
    assert [r["name"] for r in rows] == schedule_names()
    base = next(r for r in rows if r["name"] == "1f1b")
    assert base["makespan_ratio"] == pytest.approx(1.0) and base["memory_ratio"] == pytest.approx(1.0)
    gpipe = next(r for r in rows if r["name"] == "gpipe")
    assert gpipe["peak_memory"] == pytest.approx(16.0) and gpipe["memory_ratio"] == pytest.approx(4.0)
    for row in rows:
        assert set(row) == {"name", "v", "k", "makespan", "bubble_rate", "peak_memory",
                            "makespan_ratio", "memory_ratio", "error"}
        assert (row["error"] is None) == (row["makespan"] is not None)


def test_compare_rows_explain_unservable_schedules() -> None:
    rows = compare_rows(4, 0, costs=Costs())  # no schedule can run zero micro-batches
    assert all(r["error"] and "micro-batches" in r["error"] for r in rows)
    assert all("\n" not in r["error"] for r in rows)
    assert "micro-batches" in format_table(rows, style="text")


@pytest.mark.parametrize("style", ["markdown", "text"])
def test_format_table_is_aligned(style: str) -> None:
    rows = compare_rows(4, 8, costs=Costs())
    lines = format_table(rows, style=style).splitlines()
    assert len(lines) == len(rows) + 2
    assert "schedule" in lines[0] and "bubble" in lines[0]
    if style == "markdown":
        assert all(line.startswith("|") and line.endswith("|") for line in lines)
        assert len({len(line) for line in lines}) == 1
        assert set(lines[1]) <= set("|-:")


def test_format_table_rejects_unknown_style() -> None:
    with pytest.raises(ValueError, match="markdown"):
        format_table([], style="html")


def test_rank_rows_has_one_line_per_rank() -> None:
    _, result = _run("gpipe", 4, 8)
    _, base = _run("1f1b", 4, 8)
    lines = rank_rows(result, base).splitlines()
    assert len(lines) == 2 + 4
    assert "2.00x" in lines[2]  # gpipe rank 0 holds 8 M_B against 1f1b's 4


def test_no_heavy_imports_in_pure_layer() -> None:
    # A fresh interpreter: importing the CLI must not drag in torch, deepspeed or matplotlib.
    code = "import sys, ds_vshape.cli; print(sorted(m for m in ('torch', 'deepspeed', 'matplotlib') if m in sys.modules))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
