"""recipes/compare_runs.py: medians over the steps that ran without the activation meter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recipes.compare_runs import load_run


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(step: int, seconds: float, peak: int | None, **extra: Any) -> dict[str, Any]:
    return {"step": step, "loss": 1.0, "step_time_s": seconds, "tokens_per_s": 100 / seconds, "lr": 0.0,
            "peak_activation_bytes": [peak, peak], **extra}


def test_metered_steps_stay_out_of_the_medians_but_give_the_peaks(tmp_path: Path) -> None:
    rows = [_row(1, 9.0, 500, metered=True), _row(2, 1.0, None, metered=False), _row(3, 2.0, None, metered=False),
            _row(4, 3.0, None, metered=False), _row(5, 8.0, 400, metered=True)]
    run = load_run(_write(tmp_path / "r.jsonl", rows))
    assert run.median_step_s == 2.0 and run.median_tokens_per_s == 50.0
    assert run.peak_bytes == (500, 500)


def test_rows_without_the_flag_are_all_timed(tmp_path: Path) -> None:
    run = load_run(_write(tmp_path / "old.jsonl", [_row(1, 9.0, 5), _row(2, 1.0, 5), _row(3, 2.0, 5)]))
    assert run.median_step_s == 2.0
