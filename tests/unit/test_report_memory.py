"""``benchmarks/report_memory.py`` states and simulates each case at the ``w_memory`` it ran with."""

from __future__ import annotations

from typing import Any

from benchmarks.report_memory import memory_findings, memory_rows, memory_table
from ds_vshape.config import PipelineConfig
from ds_vshape.schedules import Costs, generate, simulate


def _case(schedule: str, peaks: list[int], *, w_memory: float | None) -> dict[str, Any]:
    ranks = [{"steps": [{"peak_activation_bytes": b, "step_s": 1.0}, {"peak_activation_bytes": b, "step_s": 1.0}],
              "stage_parts": [0, 1, 2, 3, 4], "m": 8, "kept_share": {"0": 0.7}} for b in peaks]
    record = {"kind": "case", "schedule": schedule, "method": "parameters", "round": 0, "p": 2, "ranks": ranks}
    if w_memory is not None:
        record["w_memory"] = w_memory
    return record


def test_the_report_simulates_and_states_the_runs_w_memory() -> None:
    rows = memory_rows([_case("1f1b", [400, 300], w_memory=0.25), _case("v-half", [350, 340], w_memory=0.25)])
    v_half = next(r for r in rows if r["schedule"] == "v-half")
    assert v_half["w_memory"] == 0.25
    want = simulate(generate("v-half", 2, 8, costs=Costs(w_memory=0.25))).max_peak_memory
    assert v_half["sim_peak_mb"] == want
    text = memory_table(rows) + "\n".join(memory_findings(rows))
    assert "w_memory 0.25 / measured share" in text and "Costs(w_memory=0.25)" in text and "`w_memory` 0.25" in text
    assert "0.5" not in text.replace("0.50", "")  # no constant plan left in the report


def test_a_case_without_w_memory_is_read_at_the_configs_default() -> None:
    rows = memory_rows([_case("1f1b", [400, 300], w_memory=None), _case("v-half", [350, 340], w_memory=None)])
    default = PipelineConfig.model_fields["w_memory"].default
    assert {r["w_memory"] for r in rows} == {default}
    assert f"w_memory {default:g} / measured share" in memory_table(rows)
