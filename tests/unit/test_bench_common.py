"""benchmarks/common.py: the record and status line every bench shares, as the benches print them."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import append_jsonl, case_status, cell, record_case


def _steps(*seconds: float) -> dict[str, list[dict[str, float]]]:
    return {"steps": [{"step_s": s} for s in seconds]}


def test_record_case_appends_one_line_and_reports_rank_0s_median(tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    append_jsonl(out, {"kind": "latency"})
    gathered = [_steps(3.0, 1.0, 2.0), _steps(9.0)]
    status = record_case(out, {"kind": "case", "ranks": gathered}, gathered, lambda med: f"step {med:.3f} s")
    assert status == "step 2.000 s"  # rank 0's median, as bench_emulated printed it
    assert [json.loads(line)["kind"] for line in out.read_text().splitlines()] == ["latency", "case"]


def test_a_rank_error_wins_over_the_median_and_is_cut() -> None:
    gathered = [_steps(1.0), {"error": "RuntimeError: " + "x" * 500}]
    assert case_status(gathered, lambda med: "unused") == "ERROR RuntimeError: " + "x" * 186  # 200 characters
    assert len(case_status(gathered, lambda med: "unused", error_chars=300)) == len("ERROR ") + 300


def test_cell_leaves_a_missing_figure_as_the_table_wants_it() -> None:
    assert cell(None, ".3f") == "-"
    assert cell(None, ".3f", "") == ""
    assert cell(0.1234, "+.1%") == "+12.3%"
